"""The daemon under a hostile or faulty client: partial chunks that must not carry another
tenant's bytes, duplicate keys, leases held forever or written after they expired, thousands of
idle or refused connections, and an impersonated daemon. Each was a way to leak bytes, leak
capacity or hand an engine wrong KV."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from pathlib import Path

import pytest
import torch

from kvtier.core.keys import bind_keys
from kvtier.server import protocol
from kvtier.server.client import StoreClient

from ..conftest import make_kv
from .test_daemon import LAYOUT, Daemon, assert_loaded, out_buffers
from .test_leases import wait_until

C = LAYOUT.chunk_tokens
TAIL = C // 4  # a partial chunk of 4 tokens: one page of this layout


def fill(lease, byte: int) -> None:
    for view in lease.views:
        if view is not None:
            view.fill_(byte)


def ssd_file(tmp: Path, client: StoreClient, key: bytes, tenant: str) -> Path:
    bound = bind_keys(client.namespace().with_tenant(tenant), [key])[0].hex()
    return tmp / "ssd" / "chunks" / bound[:2] / f"{bound}.kvc"


# -- partial chunks -----------------------------------------------------------------------------
def test_a_partial_chunk_costs_its_own_size_and_never_carries_a_previous_occupants_bytes(tmp_path):
    """Tenant a fills DRAM with chunks of 0xAA, which are then evicted; tenant b saves a partial
    chunk into a reused slot. Its DRAM slot, its SSD file and what a load reads are its own size
    and hold b's bytes only."""
    daemon = Daemon(tmp_path, host_chunks=4, write_through=True).start()
    a = daemon.client(tenant="a")
    b = daemon.client(tenant="b")
    try:
        for round_ in range(3):  # 12 full chunks through a DRAM of 4: every slot reused
            keys = a.keys_for(list(range(round_ * 4 * C, (round_ + 1) * 4 * C)))
            lease = a.reserve(keys)
            assert lease is not None and all(v is not None for v in lease.views)
            fill(lease, 0xAA)
            assert a.commit(lease) == 4
        assert a.flush()
        used = b.stats()["tiers"]["host"]["used_bytes"]
        tail_key = b.keys_for(list(range(7000, 7000 + C)))[0]  # stands for a tail key
        lease = b.reserve([tail_key], tail_tokens=TAIL)
        assert lease is not None and lease.views[0].numel() == LAYOUT.part_bytes(TAIL)
        fill(lease, 0xBB)
        assert b.commit(lease) == 1
        assert b.flush()
        s = b.stats()
        # DRAM: a page, not a chunk's slot (an eviction may have freed one of a's meanwhile)
        assert s["tiers"]["host"]["used_bytes"] - used <= LAYOUT.part_bytes(TAIL)
        data = ssd_file(tmp_path, b, tail_key, "b").read_bytes()
        assert len(data) == 4096 + LAYOUT.part_bytes(TAIL)  # header + its own bytes on SSD
        assert data[4096:] == b"\xbb" * LAYOUT.part_bytes(TAIL) and b"\xaa" * 16 not in data
        got = b.acquire([tail_key], tail_tokens=TAIL)
        assert got is not None and got.views[0].numel() == LAYOUT.part_bytes(TAIL)
        assert bool((got.views[0] == 0xBB).all())
        assert b.release(got)
        # asked for as a full chunk (or another size), it is not handed out at all
        assert b.acquire([tail_key]) is None
        assert b.acquire([tail_key], tail_tokens=TAIL + 1) is None
        assert b.stats()["pinned_chunks"] == 0
    finally:
        a.close()
        b.close()
        daemon.stop()


def test_a_partial_chunk_in_the_remote_tier_is_its_own_size(tmp_path, valkey_standalone):
    import valkey

    prefix = f"tail{os.getpid()}"
    daemon = Daemon(tmp_path, host_chunks=4, write_through=True, extra=(
        "[remote]", 'backend = "valkey"', "[remote.valkey]",
        f'addresses = ["{valkey_standalone.address}"]', 'capacity_bytes = "64MiB"', f'prefix = "{prefix}"',
    )).start()
    b = daemon.client()
    try:
        key = b.keys_for(list(range(C)))[0]
        lease = b.reserve([key], tail_tokens=TAIL)
        fill(lease, 0xBB)
        assert b.commit(lease) == 1 and b.flush()
        host, port = valkey_standalone.address.split(":")
        r = valkey.Valkey(host=host, port=int(port))
        sizes = [r.strlen(k) for k in r.scan_iter(f"*{prefix}*") if r.type(k) == b"string"]
        assert sizes and max(sizes) < LAYOUT.part_bytes(TAIL) + 1024  # its bytes and a header
    finally:
        b.close()
        daemon.stop()
    # another machine (its own DRAM and SSD) brings the tail up from the remote tier at its size
    (tmp_path / "second").mkdir()
    other = Daemon(tmp_path / "second", host_chunks=4, write_through=True, extra=(
        "[remote]", 'backend = "valkey"', "[remote.valkey]",
        f'addresses = ["{valkey_standalone.address}"]', 'capacity_bytes = "64MiB"', f'prefix = "{prefix}"',
    )).start()
    c = other.client()
    try:
        c.lookup_keys([key])  # as an engine looks up before it loads: found in the remote tier
        assert c.acquire([key]) is None  # asked for as a full chunk: a miss, not an error
        assert c.errors == 0
        got = c.acquire([key], tail_tokens=TAIL)
        assert got is not None and got.views[0].numel() == LAYOUT.part_bytes(TAIL)
        assert bool((got.views[0] == 0xBB).all()) and got.tiers == ["valkey"]
        assert c.release(got) and c.stats()["pinned_chunks"] == 0
    finally:
        c.close()
        other.stop()


# -- duplicate keys -------------------------------------------------------------------------------
def test_duplicate_keys_in_one_request_are_refused_and_no_pin_is_left(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=2, write_through=False).start()
    a = daemon.client()
    try:
        tokens = list(range(2 * C))
        assert a.save(tokens, make_kv(LAYOUT, 2 * C)).stored == 2
        k = a.keys_for(tokens)[0]
        conn = a._link.connect()
        for op in ("acquire", "reserve"):
            with pytest.raises(Exception, match="appears twice"):
                a._link.exchange(conn, {"op": op, "lease": 77, "keys": [k, k]})
        assert a.acquire([k, k]) is None  # through the client: an error, a miss
        a.close()
        b = daemon.client()
        s = b.stats()
        assert s["tiers"]["host"]["pinned"] == 0 and s["pinned_chunks"] == 0
        # nothing is pinned for good: DRAM still takes new chunks (the old ones go to SSD)
        assert b.save(list(range(900, 900 + 2 * C)), make_kv(LAYOUT, 2 * C, seed=3)).stored == 2
        b.close()
    finally:
        daemon.stop()


# -- leases of live connections have a TTL --------------------------------------------------------
def test_a_read_lease_held_past_its_ttl_is_ended_and_not_trusted(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=4, extra=("[access]", "lease_ttl_s = 0.5")).start()
    a = daemon.client()
    try:
        tokens = list(range(2 * C))
        a.save(tokens, make_kv(LAYOUT, 2 * C))
        lease = a.acquire(a.keys_for(tokens))
        assert lease is not None and daemon.stats()["pinned_chunks"] == 2
        wait_until(lambda: daemon.stats()["expired_reads"] == 1)
        assert daemon.stats()["pinned_chunks"] == 0  # its holder is alive and connected
        assert a.release(lease) is False  # what it read cannot be trusted
    finally:
        a.close()
        daemon.stop()


def _late_write_while_another_chunk_takes_the_slot(daemon: Daemon, writer: StoreClient, lease) -> None:
    """Another client saves chunks into every slot DRAM has (all but the expired lease's), twice
    over (the first ones go to SSD), then the expired lease's holder writes its slot late: the
    other client's chunks are intact, in DRAM and on SSD."""
    other = daemon.client()
    try:
        seqs = [(list(range(base, base + 2 * C)), make_kv(LAYOUT, 2 * C, seed=base)) for base in (5000, 6000)]
        for tokens, kv in seqs:
            assert other.save(tokens, kv).stored == 2
        assert daemon.stats()["tiers"]["host"]["reserved"] == 1  # the expired lease's slot, still
        fill(lease, 0x77)  # the late write
        for tokens, kv in reversed(seqs):
            out = out_buffers(2 * C)
            assert other.load(other.lookup(tokens), out).tokens == 2 * C
            assert_loaded(out, kv, 2 * C)
    finally:
        other.close()


def test_a_write_lease_past_its_ttl_is_fenced_and_its_late_write_lands_nowhere_else(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=3, write_through=False,
                    extra=("[access]", "lease_ttl_s = 0.5")).start()
    w = daemon.client()
    try:
        lease = w.reserve(w.keys_for(list(range(C))))
        assert lease is not None
        wait_until(lambda: daemon.stats()["fenced_writes"] == 1)
        assert daemon.stats()["tiers"]["host"]["reserved"] == 1  # still reserved: w may write it
        _late_write_while_another_chunk_takes_the_slot(daemon, w, lease)
        assert w.commit(lease) == 0 and w.lost_leases == 1  # never stored...
        assert daemon.stats()["tiers"]["host"]["reserved"] == 0  # ...and freed once w said so
        assert w.lookup(list(range(C))).hit_tokens == 0
    finally:
        w.close()
        daemon.stop()


def test_an_orphaned_write_slot_is_quarantined_never_reused_while_its_writer_lives(tmp_path):
    """The writer's connection is lost (the daemon stalled past its timeout); the writer, alive,
    never says it stopped. Past ``orphan_report_s`` the slot is reported, not reused: a late
    write lands in it and nowhere else."""
    daemon = Daemon(tmp_path, host_chunks=3, write_through=False,
                    extra=("[access]", "orphan_report_s = 0.3")).start()
    w = daemon.client(timeout_s=0.5, retry_s=0.05)
    try:
        lease = w.reserve(w.keys_for(list(range(C))))
        assert lease is not None
        daemon.pause()
        try:
            w.lookup(list(range(C)))  # times out: the connection and the lease are lost
        finally:
            daemon.resume()
        wait_until(lambda: daemon.stats()["quarantined_writes"] == 1)
        time.sleep(0.5)
        assert daemon.stats()["orphaned_writes"] == 1
        _late_write_while_another_chunk_takes_the_slot(daemon, w, lease)
        assert w.commit(lease) == 0
        w.lookup(list(range(C)))  # the next connection says it is done: freed now
        wait_until(lambda: daemon.stats()["orphaned_writes"] == 0)
    finally:
        w.close()
        daemon.stop()


FORGET_AS = """
import socket, sys
from kvtier.server import protocol
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
protocol.send(s, {"op": "hello", "version": protocol.VERSION, "client": bytes.fromhex(sys.argv[2])})
assert protocol.recv(s)["ok"]
protocol.send(s, {"op": "forget", "leases": [int(sys.argv[3])]})
print(protocol.recv(s)["freed"])
"""


def test_only_the_process_that_held_an_orphan_can_free_it_and_a_repeated_lease_id_leaks_nothing(tmp_path):
    """A client id is the client's own choice: another process naming it (and the lease id)
    frees nothing -- it would let a late write of the real holder land in another chunk. A
    client that names one lease id on two connections gets two orphans, both freed later."""
    import subprocess
    import sys

    daemon = Daemon(tmp_path, host_chunks=6, write_through=False).start()
    w = daemon.client(retry_s=0.0)
    try:
        for round_ in range(2):  # the same client id and lease id twice, each connection dropped
            conn = w._link.connect()
            reply = w._link.exchange(conn, {"op": "reserve", "lease": 5, "keys": [bytes([round_]) * 16]})
            assert reply["ok"] and reply["slots"][0] >= 0
            w._link.drop(conn)
        wait_until(lambda: daemon.stats()["orphaned_writes"] == 2)
        assert daemon.stats()["tiers"]["host"]["reserved"] == 2
        out = subprocess.run([sys.executable, "-c", FORGET_AS, str(daemon.socket), w._id.hex(), "5"],
                             capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2])
        assert out.stdout.strip() == "0"  # another process: nothing freed
        assert daemon.stats()["orphaned_writes"] == 2
        conn = w._link.connect()
        assert w._link.exchange(conn, {"op": "forget", "leases": [5]})["freed"] == 2  # its holder: both
        s = daemon.stats()
        assert s["orphaned_writes"] == 0 and s["tiers"]["host"]["reserved"] == 0
        assert w.lookup(list(range(C))).hit_tokens == 0  # served as ever
    finally:
        w.close()
        daemon.stop()


# -- connections ----------------------------------------------------------------------------------
def _hello(path: Path) -> tuple[socket.socket, dict | None]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    protocol.send(s, {"op": "hello", "version": protocol.VERSION, "client": os.urandom(16)})
    return s, protocol.recv(s)


def test_idle_and_refused_clients_hold_no_thread_each(tmp_path):
    daemon = Daemon(tmp_path, extra=("[access]", "max_clients = 60")).start()
    socks = []
    try:
        replies = []
        for _ in range(160):
            s, reply = _hello(daemon.socket)
            socks.append(s)
            replies.append(reply)
        served = [r for r in replies if r and r.get("ok")]
        refused = [r for r in replies if r and r.get("refused")]
        assert len(served) == 60 and len(refused) == 100  # every refused client is told why
        assert "at most 60 clients" in refused[0]["error"]
        time.sleep(1.5)  # all idle now: parked
        s0 = socks[0]  # an idle client can still talk
        protocol.send(s0, {"op": "stats"})
        reply = protocol.recv(s0)
        assert reply is not None and reply["ok"]
        snap = reply["stats"]
        assert snap["clients"] == 60 and snap["refused_clients"] == 100
        # a thread each (the code before the event loop) would be 160 and more
        assert snap["threads"] < 30, f"{snap['threads']} threads for 60 idle and 100 refused clients"
    finally:
        for s in socks:
            s.close()
        daemon.stop()


# -- who the daemon is ----------------------------------------------------------------------------
def _default_socket_env(monkeypatch, runtime: Path) -> None:
    monkeypatch.delenv("KVTIER_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))


def test_a_default_socket_directory_others_could_write_is_refused(tmp_path, monkeypatch, caplog):
    from kvtier.errors import ConfigError
    from kvtier.server.config import daemon_config

    runtime = tmp_path / "run"
    runtime.mkdir()
    _default_socket_env(monkeypatch, runtime)
    raw = {"host": {"capacity_bytes": 8 * LAYOUT.chunk_bytes, "extent_bytes": LAYOUT.chunk_bytes}}
    for mode in (0o755, 0o777, 0o770):
        os.chmod(runtime, mode)
        with pytest.raises(ConfigError, match=f"mode {mode:o}"):
            daemon_config(raw)
        client = StoreClient(model="m@1", layout=LAYOUT, retry_s=0.0)
        assert client.lookup(list(range(C))).hit_tokens == 0
        assert f"has mode {mode:o}" in caplog.text
        client.close()
    os.chmod(runtime, 0o700)
    if os.geteuid() == 0:
        os.chown(runtime, 12345, -1)
        with pytest.raises(ConfigError, match="belongs to uid 12345"):
            daemon_config(raw)
        os.chown(runtime, 0, -1)
    assert daemon_config(raw).socket_path == str(runtime / "kvtier.sock")


def test_the_default_socket_directory_in_tmp_is_made_private(tmp_path, monkeypatch):
    from kvtier.server.runtime import default_socket_path, ensure_socket_dir

    monkeypatch.delenv("KVTIER_SOCKET", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = default_socket_path()
    assert path == f"/tmp/kvtier-{os.getuid()}/kvtier.sock"
    ensure_socket_dir(path)
    st = os.lstat(os.path.dirname(path))
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0


def _serve_as(uid: int, path: Path, hello: dict) -> int:
    """Fault injection: a process of another user answering hellos on ``path`` (forked, so it
    needs nothing it cannot read as that user). Returns its pid."""
    pid = os.fork()
    if pid:
        deadline = time.monotonic() + 10
        while not path.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return pid
    try:  # the child: never returns into pytest
        os.setgid(uid)
        os.setuid(uid)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        srv.listen(8)
        while True:
            conn, _ = srv.accept()
            with contextlib.suppress(OSError, protocol.ProtocolError):
                while (msg := protocol.recv(conn)) is not None:
                    protocol.send(conn, hello if msg.get("op") == "hello" else {"ok": True, "tiers": []})
            conn.close()
    finally:
        os._exit(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_daemon_of_another_user_is_not_trusted_unless_configured(tmp_path, caplog):
    from .test_trust import good_hello

    shared = Path(f"/tmp/kvtier-imp-{os.getpid()}")
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    arena = Path("/dev/shm") / ("kvtier-" + os.urandom(16).hex())
    arena.write_bytes(bytes(1 << 16))
    os.chown(arena, 12345, 12345)
    pid = _serve_as(12345, shared / "kv.sock", good_hello(arena.name, 1 << 16))
    try:
        plain = StoreClient(str(shared / "kv.sock"), model="m@1", layout=LAYOUT, retry_s=0.0)
        assert plain.lookup(list(range(C))).hit_tokens == 0
        assert "runs as uid 12345" in caplog.text
        assert plain.lookup_keys(plain.keys_for(list(range(C)))) == []
        plain.close()
        trusting = StoreClient(str(shared / "kv.sock"), model="m@1", layout=LAYOUT, retry_s=0.0,
                               daemon_uid=12345)
        assert trusting.lookup(list(range(C))).hit_tokens == 0 and trusting.errors == 0  # it talks
        trusting.close()
        os.chown(arena, 0, 0)  # an arena that is not the daemon's own
        again = StoreClient(str(shared / "kv.sock"), model="m@1", layout=LAYOUT, retry_s=0.0,
                            daemon_uid=12345)
        assert again.lookup(list(range(C))).hit_tokens == 0 and again.errors == 1
        assert "belongs to uid 0, the daemon runs as 12345" in caplog.text
        again.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        arena.unlink()
        for p in shared.iterdir():
            p.unlink()
        shared.rmdir()


def test_a_world_or_executable_access_mode_is_refused(tmp_path):
    from kvtier.errors import ConfigError
    from kvtier.server.config import daemon_config

    for mode in ("0777", "0666", "0606", "0700", "0670"):
        raw = {"socket": str(tmp_path / "kv.sock"), "host": {"capacity_bytes": 1 << 20},
               "access": {"mode": mode}}
        with pytest.raises(ConfigError, match="access mode must be"):
            daemon_config(raw)
    for mode in ("0600", "0640", "0660"):
        raw = {"socket": str(tmp_path / "kv.sock"), "host": {"capacity_bytes": 1 << 20},
               "access": {"mode": mode}}
        assert daemon_config(raw).access.mode == int(mode, 8)


def test_the_removed_orphan_grace_key_says_what_replaced_it(tmp_path):
    from kvtier.errors import ConfigError
    from kvtier.server.config import daemon_config

    raw = {"socket": str(tmp_path / "kv.sock"), "host": {"capacity_bytes": 1 << 20},
           "access": {"orphan_grace_s": 5}}
    with pytest.raises(ConfigError, match="orphan_report_s"):
        daemon_config(raw)


def test_torch_is_not_asked_for_cuda_by_a_client_that_maps_no_arena(tmp_path, monkeypatch):
    """vLLM's scheduler only asks questions: its client maps no arena and never page-locks one
    (a CUDA call, which would make a CUDA context in the engine-core process)."""
    daemon = Daemon(tmp_path).start()
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or False)
    try:
        c = StoreClient(str(daemon.socket), model="m@1", layout=LAYOUT, map_arena=False)
        assert c.lookup(list(range(C))).hit_tokens == 0 and c.errors == 0
        with pytest.raises(ValueError, match="maps no arena"):
            c._link.connect().mapped()
        w = daemon.client()
        assert w.save(list(range(C)), make_kv(LAYOUT, C)).stored == 1 and w.flush()
        for call in (c.acquire, c.reserve):  # refused before the daemon grants anything
            with pytest.raises(ValueError, match="maps no arena"):
                call(c.keys_for(list(range(C))))
        assert daemon.stats()["leased_pins"] == 0
        wait_until(lambda: daemon.stats()["pinned_chunks"] == 0)  # (a write-through copy pins it a moment)
        w.close()
        maps = Path(f"/proc/{os.getpid()}/maps").read_text()
        assert daemon.stats()["arena"] not in maps and calls == []
        c.close()
    finally:
        daemon.stop()


def test_the_daemons_reads_and_writes_are_bounded_per_message_not_per_call():
    """The daemon gives a request READ_TIMEOUT_S from its first byte to arrive whole, and a
    reply as long to be read: a fresh timeout for every read (or write) let a client hold a
    worker thread for ever by sending (or reading) a byte now and then."""
    import threading

    a, b = socket.socketpair()
    a.settimeout(None)  # as the daemon's: blocking, the kernel's timeouts per read
    try:
        assert protocol.recv_request(a, 0.0, 1.0) is protocol.IDLE  # nothing there: park at once
        began = time.monotonic()
        assert protocol.recv_request(a, 0.2, 1.0) is protocol.IDLE
        assert 0.15 < time.monotonic() - began < 1.0
        message = {"op": "lookup", "keys": [b"k" * 16]}
        raw = protocol.HEADER.pack(len(protocol.msgpack.packb(message, use_bin_type=True)))
        b.sendall(raw + protocol.msgpack.packb(message, use_bin_type=True))
        assert protocol.recv_request(a, 1.0, 1.0) == message
        b.sendall(raw[:2])  # half a header, then silence
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            protocol.recv_request(a, 1.0, 0.4)
        assert time.monotonic() - began < 1.0

        def trickle() -> None:  # a byte every 50 ms: each read is quick, the message never whole
            try:
                for byte in protocol.HEADER.pack(64) + b"x" * 64:
                    b.send(bytes([byte]))
                    time.sleep(0.05)
            except OSError:
                pass

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            protocol.recv_request(a, 1.0, 0.5)
        assert time.monotonic() - began < 1.5
        sender.join()
    finally:
        a.close()
        b.close()
    # a reply the peer never reads: the write gives up after its bound, not never
    a, b = socket.socketpair()
    a.settimeout(None)
    try:
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            protocol.send(a, {"ok": True, "blob": b"x" * (4 << 20)}, within_s=0.5)
        assert time.monotonic() - began < 2.0
    finally:
        a.close()
        b.close()
