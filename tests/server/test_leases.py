"""Leases under fault: a daemon stalled past the client's timeout, a daemon restarted under
live views, a client that loses a lease mid-write. What was read under a lost lease never
reaches a model; a view never points at unmapped memory; a lost write never lands."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.server.client import StoreClient
from kvtier.server.daemon import DaemonConfig, StoreDaemon
from kvtier.store.cache import CacheConfig
from kvtier.tiers.host_config import HostTierConfig

from ..conftest import make_kv
from .test_daemon import LAYOUT, MODEL, Daemon, assert_loaded, out_buffers

C = LAYOUT.chunk_tokens


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def overwrite_dram(daemon: Daemon, chunks: int, salt: int) -> None:
    """Another client fills DRAM with other chunks, so freed slots get other bytes."""
    other = daemon.client()
    tokens = [10_000 + salt * 1000 + i for i in range(chunks * C)]
    assert other.save(tokens, make_kv(LAYOUT, chunks * C, seed=99 + salt)).stored == chunks
    other.close()


def test_a_daemon_stalled_past_the_timeout_loses_the_lease_and_what_was_read_is_not_trusted(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=4, write_through=False).start()
    client = daemon.client(timeout_s=0.5, retry_s=0.05)
    try:
        tokens = list(range(4 * C))
        kv = make_kv(LAYOUT, 4 * C, seed=1)
        assert client.save(tokens, kv).stored == 4
        lease = client.acquire(client.keys_for(tokens))
        assert lease is not None and len(lease.views) == 4
        before = [v.clone() for v in lease.views]
        daemon.pause()  # a daemon operation that takes longer than the client's timeout
        try:
            assert client.lookup(tokens).hit_tokens == 0  # timed out: a miss, the connection dropped
        finally:
            daemon.resume()
        wait_until(lambda: daemon.stats()["pinned_chunks"] == 0)  # the daemon ended the lease
        overwrite_dram(daemon, 4, salt=1)  # its slots now hold other chunks
        assert any(not torch.equal(v, b) for v, b in zip(lease.views, before))  # the danger, shown
        assert client.release(lease) is False  # ...so nothing read through it is used
        assert client.lost_leases == 1
        assert client.stats()["engine_load_failures"] == 4  # told on the next connection
        out = out_buffers(4 * C)
        hit = client.lookup(tokens)  # reconnected; the chunks went to SSD to make room
        got = client.load(hit, out)
        assert got.tokens == 4 * C
        assert_loaded(out, kv, 4 * C)
    finally:
        client.close()
        daemon.stop()


def test_load_throws_away_a_round_whose_lease_was_lost(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=4, write_through=False).start()
    client = daemon.client(timeout_s=0.5, retry_s=0.05)
    try:
        tokens = list(range(4 * C))
        kv = make_kv(LAYOUT, 4 * C, seed=2)
        client.save(tokens, kv)
        hit = client.lookup(tokens)
        real = client.acquire

        def stalled(*args, **kw):  # the daemon stalls right after handing out the views
            lease = real(*args, **kw)
            daemon.pause()
            try:
                client.stats  # noqa: B018 - a call on the same client times out
                assert client.lookup(tokens).hit_tokens == 0
            finally:
                daemon.resume()
            wait_until(lambda: daemon.stats()["pinned_chunks"] == 0)
            overwrite_dram(daemon, 4, salt=2)
            return lease

        client.acquire = stalled
        out = out_buffers(4 * C)
        assert client.load(hit, out).tokens == 0  # the round's bytes were another chunk's: not used
        client.acquire = real
        assert client.load(client.lookup(tokens), out).tokens == 4 * C
        assert_loaded(out, kv, 4 * C)
    finally:
        client.close()
        daemon.stop()


def test_a_daemon_restarted_under_live_views_leaves_the_client_alive(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=8).start()
    client = daemon.client(retry_s=0.05)
    try:
        tokens = list(range(4 * C))
        client.save(tokens, make_kv(LAYOUT, 4 * C, seed=3))
        assert client.flush()  # written through to SSD
        read = client.acquire(client.keys_for(tokens))
        write = client.reserve(client.keys_for(list(range(500, 500 + 2 * C))))
        assert read is not None and write is not None and all(v is not None for v in write.views)
        old_arena = client.stats()["arena"]
        daemon.kill()
        daemon.start()
        assert client.lookup(tokens).hit_tokens == 4 * C  # reconnected to the new daemon (SSD)
        assert client.stats()["arena"] != old_arena
        # the old views still point at mapped memory: touching them is harmless
        total = sum(float(v.sum()) for v in read.views)
        assert math.isfinite(total)
        for v in write.views:
            v.fill_(5)
        assert client.release(read) is False  # lost with the daemon that granted it
        assert client.commit(write) == 0  # nothing written under a lost lease is stored
        assert client.lookup(list(range(500, 500 + 2 * C))).hit_tokens == 0
        del read, write, v  # the last views of the old arena
        gc.collect()
        maps = Path(f"/proc/{os.getpid()}/maps").read_text()
        assert old_arena not in maps  # unmapped once its last lease ended and no view is left
    finally:
        client.close()
        daemon.stop()


def test_a_lost_write_lease_keeps_its_slots_until_the_client_says_it_stopped_writing(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=4, extra=("[access]", "orphan_report_s = 600")).start()
    client = daemon.client(timeout_s=0.5, retry_s=0.05)
    try:
        keys = client.keys_for(list(range(2 * C)))
        lease = client.reserve(keys)
        assert lease is not None
        daemon.pause()
        try:
            client.lookup(list(range(C)))  # times out: the connection (and the lease) is lost
        finally:
            daemon.resume()
        wait_until(lambda: daemon.stats()["orphaned_writes"] == 2)
        # this process is alive and may still write those slots: the daemon keeps them reserved
        overwrite_dram(daemon, 2, salt=3)  # the other two slots
        s = daemon.stats()
        assert s["orphaned_writes"] == 2 and s["tiers"]["host"]["used_bytes"] == 4 * LAYOUT.chunk_bytes
        for v in lease.views:
            v.fill_(9)  # a late write lands in a slot nobody else has
        assert client.commit(lease) == 0
        client.lookup(list(range(C)))  # the next connection tells the daemon it is done
        wait_until(lambda: daemon.stats()["orphaned_writes"] == 0)
    finally:
        client.close()
        daemon.stop()


def test_two_clients_saving_the_same_prefix_at_once_both_succeed(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=8).start()
    a, b = daemon.client(), daemon.client()
    try:
        system = list(range(2 * C))
        la = a.reserve(a.keys_for(system))  # two requests in one vLLM step share a system prompt
        lb = b.reserve(b.keys_for(system + list(range(900, 900 + C))))
        assert la is not None and lb is not None
        assert all(v is not None for v in la.views)
        assert lb.views[0] is None and lb.views[1] is None and not any(lb.held[:2])  # busy: skip
        assert lb.views[2] is not None
        kv = make_kv(LAYOUT, 3 * C, seed=4)
        from kvtier.store.packing import check_kv, pack_chunk

        layers, _ = check_kv(kv, LAYOUT)
        for i, v in enumerate(la.views):
            pack_chunk(v, layers, i, LAYOUT)
        pack_chunk(lb.views[2], layers, 2, LAYOUT)
        assert a.commit(la) == 2 and b.commit(lb) == 1
        assert a.lookup(system + list(range(900, 900 + C))).hit_tokens == 3 * C
        assert b.stats()["busy_chunks"] == 2
    finally:
        a.close()
        b.close()
        daemon.stop()


def test_a_client_cannot_release_or_commit_a_lease_it_does_not_hold(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=4).start()
    a, b = daemon.client(), daemon.client()
    try:
        a.save(list(range(C)), make_kv(LAYOUT, C))
        lease = a.acquire(a.keys_for(list(range(C))))
        assert lease is not None
        conn = b._link.connect()  # another connection names a's lease: refused, nothing changes
        with pytest.raises(Exception, match="not held on this connection"):
            b._link.exchange(conn, {"op": "release", "lease": lease.id})
        assert a.stats()["pinned_chunks"] == 1
        assert a.release(lease) is True
        with pytest.raises(ValueError, match="already ended"):
            a.release(lease)
    finally:
        a.close()
        b.close()
        daemon.stop()


def test_a_namespace_without_a_client_namespace_is_a_clear_error(tmp_path):
    daemon = Daemon(tmp_path).start()
    try:
        bare = StoreClient(str(daemon.socket))
        with pytest.raises(ValueError, match="no namespace"):
            bare.lookup([1, 2, 3])
        assert bare.stats()["clients"] >= 1  # stats need no namespace
        bare.close()
        with pytest.raises(ValueError, match="both model and layout"):
            StoreClient(str(daemon.socket), model=MODEL)
    finally:
        daemon.stop()


def test_a_save_with_no_room_at_all_returns_at_once_instead_of_spinning(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=4, write_through=False).start()
    a, b = daemon.client(), daemon.client()
    try:
        tokens = list(range(4 * C))
        assert a.save(tokens, make_kv(LAYOUT, 4 * C, seed=1)).stored == 4
        lease = a.acquire(a.keys_for(tokens))  # a reader pins all of DRAM
        assert lease is not None
        t0 = time.monotonic()
        res = b.save(list(range(900, 900 + C)), make_kv(LAYOUT, C, seed=2))
        assert res.stored == 0 and res.dropped == 1 and time.monotonic() - t0 < 4.0
        assert a.release(lease)
    finally:
        a.close()
        b.close()
        daemon.stop()


def test_a_reserve_whose_reply_never_came_is_forgotten_on_the_next_connection(tmp_path):
    daemon = Daemon(tmp_path, host_chunks=4, write_through=False).start()
    client = daemon.client(timeout_s=0.5, retry_s=0.05)
    try:
        assert client.lookup(list(range(C))).hit_tokens == 0  # connected
        daemon.pause()
        try:
            assert client.reserve(client.keys_for(list(range(4 * C)))) is None  # timed out
        finally:
            daemon.resume()
        wait_until(lambda: daemon.stats()["orphaned_writes"] == 4)  # granted, never seen
        time.sleep(0.1)
        client.lookup(list(range(C)))  # the next connection says: never written, free them
        wait_until(lambda: daemon.stats()["orphaned_writes"] == 0)
    finally:
        client.close()
        daemon.stop()


def test_a_forget_that_arrives_before_the_old_connection_ends_still_frees_the_slots(tmp_path):
    from kvtier.server.daemon import DaemonConfig, StoreDaemon
    from kvtier.store.cache import CacheConfig
    from kvtier.tiers.host_config import HostTierConfig

    d = StoreDaemon(DaemonConfig(str(tmp_path / "kv.sock"), CacheConfig(
        HostTierConfig(8 * LAYOUT.chunk_bytes, extent_bytes=LAYOUT.chunk_bytes)))).start()
    c = StoreClient(str(tmp_path / "kv.sock"), model=MODEL, layout=LAYOUT, timeout_s=0.5, retry_s=0.05)
    try:
        w = c.reserve(c.keys_for(list(range(2 * C))))
        assert w is not None and w.id is not None
        real, slow = d.cache.lookup_keys, [True]

        def lookup_keys(*a, **kw):  # one daemon operation slower than the client's timeout
            if slow[0]:
                slow[0] = False
                time.sleep(2.0)
            return real(*a, **kw)

        d.cache.lookup_keys = lookup_keys
        c.lookup(list(range(5000, 5000 + C)))  # times out: the connection and the lease are lost
        assert c.commit(w) == 0  # the caller ended it: the client will say so
        c.lookup(list(range(6000, 6000 + C)))  # the forget goes out now, before the old session ends
        wait_until(lambda: d.snapshot()["orphaned_writes"] == 0 and d.leases.orphans_freed >= 1, timeout=10)
    finally:
        c.close()
        d.stop()


def test_a_flush_longer_than_the_timeout_keeps_the_connection_and_its_leases(tmp_path):
    from kvtier.server.daemon import DaemonConfig, StoreDaemon
    from kvtier.store.cache import CacheConfig
    from kvtier.tiers.host_config import HostTierConfig

    d = StoreDaemon(DaemonConfig(str(tmp_path / "kv.sock"), CacheConfig(
        HostTierConfig(8 * LAYOUT.chunk_bytes, extent_bytes=LAYOUT.chunk_bytes)))).start()
    real = d.cache.flush
    d.cache.flush = lambda timeout=None: (time.sleep(1.5), real(timeout))[1]  # 1.5 s of background work
    c = StoreClient(str(tmp_path / "kv.sock"), model=MODEL, layout=LAYOUT, timeout_s=1.0)
    try:
        tokens = list(range(2 * C))
        assert c.save(tokens, make_kv(LAYOUT, 2 * C, seed=1)).stored == 2
        lease = c.acquire(c.keys_for(tokens))
        assert lease is not None
        assert c.flush(timeout=30)  # a call meant to take long says so: no timeout
        assert c.release(lease) is True
    finally:
        c.close()
        d.stop()


def test_a_second_hello_on_one_connection_is_refused(tmp_path):
    daemon = Daemon(tmp_path).start()
    client = daemon.client()
    try:
        conn = client._link.connect()
        with pytest.raises(Exception, match="said hello already"):
            client._link.exchange(conn, client._hello())
    finally:
        client.close()
        daemon.stop()


def test_a_client_with_a_long_timeout_still_acquires_and_saves(tmp_path):
    """The budget a client gives the daemon for an acquire or reserve is capped on both sides:
    a timeout of minutes must not make every acquire and reserve a refused request."""
    daemon = Daemon(tmp_path, host_chunks=8).start()
    ok, slow = daemon.client(), daemon.client(timeout_s=300.0)
    try:
        tokens = list(range(2 * C))
        kv = make_kv(LAYOUT, 2 * C, seed=1)
        assert ok.save(tokens, kv).stored == 2
        lease = slow.acquire(slow.keys_for(tokens))
        assert lease is not None and slow.release(lease)
        assert slow.save(list(range(100, 100 + 2 * C)), make_kv(LAYOUT, 2 * C, seed=2)).stored == 2
        out = out_buffers(2 * C)
        assert slow.load(slow.lookup(tokens), out).tokens == 2 * C
        assert_loaded(out, kv, 2 * C)
        assert slow.errors == 0
    finally:
        ok.close()
        slow.close()
        daemon.stop()


REQUEST_USER = """
import sys
from kvtier.core.layout import KVLayout
from kvtier.server.client import StoreClient
c = StoreClient(sys.argv[1], model="tiny@test", layout=KVLayout(4, 2, 32, "float32", 16),
                instance=sys.argv[2] or None)
lease = c.acquire(c.keys_for(list(range(32))), request="req-1")
assert lease is not None and c.release(lease)
c.close()
"""


def test_a_request_started_by_the_scheduler_is_known_to_the_workers_of_its_instance(tmp_path):
    """vLLM's scheduler announces a request; its workers, other processes, acquire for it. The
    daemon knows the request by the instance the clients name (the engine id), so a worker's
    acquire carries the request's use; a process of another instance does not see it."""
    d = StoreDaemon(DaemonConfig(str(tmp_path / "kv.sock"), CacheConfig(
        HostTierConfig(8 * LAYOUT.chunk_bytes, extent_bytes=LAYOUT.chunk_bytes)))).start()
    uses: list[int | None] = []
    real = d.cache.acquire

    def acquire(keys, **kw):  # a spy: the real acquire runs
        uses.append(kw.get("use"))
        return real(keys, **kw)

    d.cache.acquire = acquire
    sched = StoreClient(str(tmp_path / "kv.sock"), model=MODEL, layout=LAYOUT, instance="engine-A")
    try:
        assert sched.save(list(range(2 * C)), make_kv(LAYOUT, 2 * C, seed=1)).stored == 2
        sched.started("req-1")
        for instance in ("engine-A", "engine-B", ""):
            subprocess.run([sys.executable, "-c", REQUEST_USER, str(tmp_path / "kv.sock"), instance],
                           check=True, cwd=Path(__file__).parents[2], timeout=60)
        assert uses[0] is not None and uses[1:] == [None, None]
    finally:
        sched.close()
        d.stop()
