"""The daemon's footing on the machine: its socket path, its arena's name, its metrics port,
and the bounds on what a client may send."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from kvtier.server import protocol
from kvtier.server.runtime import ARENA_NAME, SocketClaim

from ..conftest import _in_use, make_kv
from ..daemon_process import KVTIER
from .test_daemon import LAYOUT, Daemon

C = LAYOUT.chunk_tokens


def kvtier_arenas() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("kvtier-")}


def test_a_socket_path_that_is_an_existing_file_is_refused_and_kept(tmp_path):
    config = tmp_path / "kvtier.toml"
    config.write_text('[host]\ncapacity_bytes = "1MiB"\n')
    res = subprocess.run([KVTIER, "store", "serve", "--config", str(config), "--socket", str(config)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 1 and "exists and is not a socket" in res.stderr
    assert config.read_text() == '[host]\ncapacity_bytes = "1MiB"\n'  # the typo cost nothing


def test_a_busy_metrics_port_fails_before_anything_is_created(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    before = kvtier_arenas()
    try:
        res = subprocess.run([KVTIER, "store", "serve", "--socket", str(tmp_path / "kv.sock"),
                              "--host-bytes", "1MiB", "--disk-path", str(tmp_path / "ssd"),
                              "--disk-bytes", "16MiB", "--metrics-port", str(port)],
                             capture_output=True, text=True, timeout=60, check=False)
    finally:
        taken.close()
    assert res.returncode == 1 and f"cannot serve metrics on 127.0.0.1:{port}" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "kv.sock").exists() and not (tmp_path / "ssd").exists()
    # (an arena another test process's live daemon made meanwhile is not this one's)
    assert {a for a in kvtier_arenas() - before if not _in_use(a)} == set()


def test_arenas_are_named_at_random_and_only_a_dead_daemons_recorded_arena_is_removed(tmp_path):
    # An arena that looks like another daemon's (pid-named as before, or another socket's):
    # never touched, even though no process of that pid exists.
    foreign = Path("/dev/shm/kvtier-999999")
    foreign.write_bytes(b"someone else's")
    try:
        d = Daemon(tmp_path).start()
        first = d.stats()["arena"]
        assert ARENA_NAME.fullmatch(first)
        assert (tmp_path / "kv.sock.lock").read_text().strip() == first
        d.kill()  # kill -9: nothing cleaned up
        assert Path(f"/dev/shm/{first}").exists()
        d.start()  # the lock is free again, so the recorded arena's daemon is gone: removed
        second = d.stats()["arena"]
        assert second != first and not Path(f"/dev/shm/{first}").exists()
        assert foreign.read_bytes() == b"someone else's"
        d.stop()
        assert not Path(f"/dev/shm/{second}").exists()
    finally:
        foreign.unlink()


def test_a_second_claim_on_a_served_socket_is_refused(tmp_path):
    claim = SocketClaim(str(tmp_path / "kv.sock"))
    try:
        with pytest.raises(ValueError, match="another daemon is serving"):
            SocketClaim(str(tmp_path / "kv.sock"))
    finally:
        claim.release()
    SocketClaim(str(tmp_path / "kv.sock")).release()  # free once released


def test_sizes_and_counts_on_the_wire_are_bounded_and_do_not_break_stats(tmp_path):
    d = Daemon(tmp_path).start()
    try:
        client = d.client()
        client.save(list(range(2 * C)), make_kv(LAYOUT, 2 * C))
        conn = client._link.connect()
        keys = client.keys_for(list(range(2 * C)))
        for bad in [{"op": "lookup", "keys": keys, "num_tokens": 2**64 - 1},
                    {"op": "lookup", "keys": keys, "num_tokens": 2**63 - 1},
                    {"op": "lookup", "keys": keys, "num_tokens": -1},
                    {"op": "lookup", "keys": [b"short"]},
                    {"op": "lookup", "keys": "notalist"},
                    {"op": "acquire", "keys": keys, "lease": 0},
                    {"op": "queued", "keys": keys, "request_id": "x" * 10_000},
                    {"op": "nosuchop"}]:
            with pytest.raises(Exception):  # noqa: B017 - each is answered with an error naming the field
                client._link.exchange(conn, bad)
        assert client.lookup(list(range(2 * C))).hit_tokens == 2 * C
        stats = client.stats()  # still fine
        assert stats["lookup_tokens"] < 1 << 20
        client.close()
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(str(d.socket))
        protocol.send(raw, {"op": "lookup", "keys": keys})  # no hello first
        reply = protocol.recv(raw)
        assert reply is not None and not reply["ok"] and "hello" in reply["error"]
        raw.close()
    finally:
        d.stop()


def test_a_dev_shm_too_small_for_the_arena_fails_at_start_saying_so(tmp_path, monkeypatch):
    import errno

    from kvtier.tiers.arena import HostArena

    def enospc(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)  # fault: a 64 MiB /dev/shm (Docker's default)
    with pytest.raises(ValueError, match=r"enlarge /dev/shm \(docker run --shm-size\)"):
        HostArena(1 << 20, "kvtier-" + "b" * 32)
    assert not Path("/dev/shm/kvtier-" + "b" * 32).exists()
