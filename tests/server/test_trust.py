"""Trust boundaries: what a client accepts from whoever answers on the socket, what the daemon
lets each uid do, and deployment faults that must be misses, never crashes."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import threading
from pathlib import Path

import pytest

from kvtier.server import protocol
from kvtier.server.client import StoreClient

from ..conftest import make_kv
from .test_daemon import LAYOUT, MODEL, Daemon

C = LAYOUT.chunk_tokens


class FakeDaemon:
    """Fault injection: something on the socket that answers a hello with ``hello`` and every
    later request with ``replies[op]``."""

    def __init__(self, path: Path, hello: dict, replies: dict | None = None) -> None:
        self.path = str(path)
        self.hello, self.replies = hello, replies or {}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                while (msg := protocol.recv(conn)) is not None:
                    reply = self.hello if msg.get("op") == "hello" else self.replies.get(msg["op"], {"ok": True})
                    protocol.send(conn, reply)
            except (OSError, protocol.ProtocolError):
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()


def good_hello(name: str, size: int) -> dict:
    return {"ok": True, "version": protocol.VERSION, "epoch": secrets.token_bytes(16), "shm_name": name,
            "arena_bytes": size, "tiers": ["host"], "tenant": ""}


def client_of(path: Path) -> StoreClient:
    return StoreClient(str(path), model=MODEL, layout=LAYOUT, timeout_s=2.0, retry_s=0.0)


@pytest.mark.parametrize("name", ["../../tmp/kvtier-victim", "kvtier-" + "0" * 31 + "/", "passwd", "kvtier-xyz"])
def test_a_hello_naming_anything_but_a_kvtier_arena_maps_nothing(tmp_path, name, caplog):
    victim = Path("/tmp/kvtier-victim")
    victim.write_bytes(b"precious")
    fake = FakeDaemon(tmp_path / "kv.sock", good_hello(name, 1 << 20))
    try:
        client = client_of(tmp_path / "kv.sock")
        assert client.lookup(list(range(2 * C))).hit_tokens == 0
        assert client.save(list(range(2 * C)), make_kv(LAYOUT, 2 * C)).stored == 0
        assert client.errors >= 2 and "not a kvtier arena name" in caplog.text
        assert victim.read_bytes() == b"precious"
    finally:
        fake.close()
        victim.unlink()


def test_slot_offsets_outside_the_arena_are_refused(tmp_path, caplog):
    name = "kvtier-" + secrets.token_hex(16)
    shm = Path("/dev/shm") / name
    shm.write_bytes(bytes(1 << 16))
    fake = FakeDaemon(tmp_path / "kv.sock", good_hello(name, 1 << 16), {
        "reserve": {"ok": True, "lease": None, "slots": [1 << 20]},  # beyond the arena
        "acquire": {"ok": True, "lease": 1, "slots": [123], "tiers": ["host"]},  # not page-aligned
    })
    try:
        client = client_of(tmp_path / "kv.sock")
        keys = client.keys_for(list(range(C)))
        assert client.reserve(keys) is None
        assert client.acquire(keys) is None
        assert "outside its arena" in caplog.text or "malformed" in caplog.text or "another lease" in caplog.text
    finally:
        fake.close()
        shm.unlink()


def test_a_daemon_of_another_protocol_version_is_a_miss(tmp_path, caplog):
    hello = {"ok": False, "refused": True, "error": "protocol version 3 is not this daemon's (2)"}
    fake = FakeDaemon(tmp_path / "kv.sock", hello)
    try:
        client = client_of(tmp_path / "kv.sock")
        assert client.lookup(list(range(C))).hit_tokens == 0
        assert "refused this client" in caplog.text
    finally:
        fake.close()
    fake = FakeDaemon(tmp_path / "kv2.sock", {**good_hello("kvtier-" + "a" * 32, 4096), "version": 1})
    try:
        client = client_of(tmp_path / "kv2.sock")
        assert client.lookup(list(range(C))).hit_tokens == 0
        assert "speaks protocol 1" in caplog.text
    finally:
        fake.close()


def test_an_arena_this_process_cannot_map_is_a_miss_not_a_crash(tmp_path, caplog):
    daemon = Daemon(tmp_path).start()
    try:
        arena = Path("/dev/shm") / daemon.stats()["arena"]
        hidden = arena.with_name(arena.name + ".hidden")
        arena.rename(hidden)  # as if /dev/shm were another one (another container, another uid)
        client = daemon.client(retry_s=0.0)
        assert client.lookup(list(range(C))).hit_tokens == 0
        assert client.save(list(range(C)), make_kv(LAYOUT, C)).stored == 0
        assert "cannot map the daemon's arena" in caplog.text
        hidden.rename(arena)
        assert client.save(list(range(C)), make_kv(LAYOUT, C)).stored == 1  # and it recovers
        client.close()
    finally:
        daemon.stop()


def test_socket_arena_and_ssd_files_are_private_by_default(tmp_path):
    daemon = Daemon(tmp_path).start()
    try:
        client = daemon.client()
        client.save(list(range(C)), make_kv(LAYOUT, C))
        assert client.flush()
        arena = Path("/dev/shm") / client.stats()["arena"]
        assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
        assert stat.S_IMODE(arena.stat().st_mode) == 0o600
        ssd = tmp_path / "ssd"
        files = [p for p in ssd.rglob("*.kvc")]
        assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
        assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in [ssd, ssd / "chunks", ssd / "tmp"])
        client.close()
    finally:
        daemon.stop()


def test_socket_and_arena_mode_and_group_are_configurable(tmp_path):
    gid = os.getgroups()[-1] if os.getgroups() else os.getgid()
    daemon = Daemon(tmp_path, extra=("[access]", 'mode = "0660"', f"group = {gid}")).start()
    try:
        arena = Path("/dev/shm") / daemon.stats()["arena"]
        for path in (Path(daemon.socket), arena):
            st = path.stat()
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
    finally:
        daemon.stop()


def test_a_uid_may_use_only_the_tenants_it_is_allowed(tmp_path, caplog):
    uid = os.getuid()
    daemon = Daemon(tmp_path, extra=("[access.tenants]", f'"{uid}" = ["acme"]')).start()
    try:
        acme = daemon.client(tenant="acme")
        assert acme.save(list(range(2 * C)), make_kv(LAYOUT, 2 * C)).stored == 2
        assert acme.lookup(list(range(2 * C))).hit_tokens == 2 * C
        assert acme.lookup(list(range(2 * C)), tenant="globex").hit_tokens == 0  # refused: a miss
        assert "may not use tenant 'globex'" in caplog.text
        shared = daemon.client()  # the default tenant "" is not allowed for this uid
        assert shared.lookup(list(range(2 * C))).hit_tokens == 0
        assert "refused this client" in caplog.text
        acme.close()
        shared.close()
    finally:
        daemon.stop()


def test_the_daemons_tenant_is_the_tenant_of_clients_that_name_none(tmp_path):
    daemon = Daemon(tmp_path, extra=()).start()
    daemon.stop()
    cfg = daemon.config.read_text().replace("write_through", 'tenant = "acme"\nwrite_through')
    daemon.config.write_text(cfg)
    daemon.start()
    try:
        plain, acme, other = daemon.client(), daemon.client(tenant="acme"), daemon.client(tenant="globex")
        assert plain.save(list(range(2 * C)), make_kv(LAYOUT, 2 * C)).stored == 2
        assert acme.lookup(list(range(2 * C))).hit_tokens == 2 * C  # the same tenant: shared
        assert other.lookup(list(range(2 * C))).hit_tokens == 0  # another tenant: never
        for c in (plain, acme, other):
            c.close()
    finally:
        daemon.stop()


def test_clients_past_the_maximum_are_refused_and_counted(tmp_path):
    daemon = Daemon(tmp_path, extra=("[access]", "max_clients = 2")).start()
    try:
        a, b, c = daemon.client(), daemon.client(), daemon.client()
        assert a.save(list(range(C)), make_kv(LAYOUT, C)).stored == 1
        assert b.lookup(list(range(C))).hit_tokens == C
        assert c.lookup(list(range(C))).hit_tokens == 0  # refused: a miss, not a failed read
        assert a.stats()["refused_clients"] >= 1
        for x in (a, b, c):
            x.close()
    finally:
        daemon.stop()


def test_a_layout_the_daemon_cannot_hold_is_refused_with_a_clear_error(tmp_path, caplog):
    from kvtier.core.layout import KVLayout

    daemon = Daemon(tmp_path, host_chunks=8).start()  # a 256 KiB arena
    try:
        huge = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float32", chunk_tokens=256)
        client = StoreClient(str(daemon.socket), model="big@1", layout=huge)
        assert client.lookup(list(range(512))).hit_tokens == 0  # a miss, not an exception
        assert "cannot hold chunks of this layout" in caplog.text
        client.close()
    finally:
        daemon.stop()
