"""The cache under concurrency, told as stories: one caller's slow SSD read or remote round
trip never stalls another's lookup; entries keep their metadata for the policies on every path;
chunks of two sizes share DRAM; the remote level forgets what the server no longer has."""

from __future__ import annotations

import math
import threading
import time

import torch

from kvtier import DiskTierConfig, HostTierConfig, KVStore, StoreConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.store import RemoteConfig
from kvtier.store.cache import CacheConfig, ChunkCache, Slot
from kvtier.tiers.disk_format import header_len_for
from kvtier.tiers.valkey import ValkeyTierConfig
from tests.remote_servers import unique_prefix

from ..conftest import make_kv

C = 16


def store_of(layout, host_chunks: int, tmp_path=None, **kw) -> KVStore:
    disk = None
    if tmp_path is not None:
        disk = DiskTierConfig(str(tmp_path), 64 * (header_len_for(layout.num_layers) + layout.chunk_bytes))
    return KVStore(StoreConfig(model="tiny@1", layout=layout, host=HostTierConfig(host_chunks * layout.chunk_bytes),
                               disk=disk, **kw))


class Gate:
    """Fault injection: the wrapped call blocks until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()

    def wrap(self, fn):  # type: ignore[no-untyped-def]
        def blocked(*args, **kw):
            self.entered.set()
            assert self.open.wait(30), "the gate was never opened"
            return fn(*args, **kw)

        return blocked


def test_a_slow_ssd_read_stalls_nobody_else(layout, tmp_path):
    a, b = list(range(4 * C)), list(range(1000, 1000 + 2 * C))
    with store_of(layout, host_chunks=4, tmp_path=tmp_path) as store:
        store.save(a, make_kv(layout, 4 * C, seed=1))
        store.save(b, make_kv(layout, 2 * C, seed=2))  # a's deepest chunks go down to SSD
        hit = store.lookup(a)
        assert "disk" in hit.tiers
        gate = Gate()
        disk = store.cache.disk
        disk.get = gate.wrap(disk.get)  # its SSD reads hang (a slow disk, a long prefetch)
        disk.get_into = gate.wrap(disk.get_into)
        loader = threading.Thread(target=lambda: store.load(hit))
        loader.start()
        assert gate.entered.wait(10)
        t0 = time.monotonic()
        assert store.lookup(b).hit_tokens == 2 * C  # while the other caller waits on the disk
        assert store.save(list(range(2000, 2000 + C)), make_kv(layout, C, seed=3)).stored in (0, 1)
        assert store.snapshot()["lookups"] >= 2
        assert time.monotonic() - t0 < 5
        assert loader.is_alive()  # it really was stuck in the read all along
        gate.open.set()
        loader.join(30)
        assert not loader.is_alive()


def test_a_slow_remote_round_trip_stalls_nobody_else(layout, valkey_standalone):
    remote = RemoteConfig(ValkeyTierConfig((valkey_standalone.address,), 64 << 20, prefix=unique_prefix(),
                                           timeout_s=5.0), miss_s=60.0)
    with store_of(layout, host_chunks=8, remote=remote) as store:
        local = list(range(2 * C))
        store.save(local, make_kv(layout, 2 * C))
        gate = Gate()
        tier = store.cache.remote
        tier.contains_prefix = gate.wrap(tier.contains_prefix)  # the server is slow to answer
        probe = threading.Thread(target=lambda: store.lookup(list(range(5000, 5000 + 2 * C))))
        probe.start()
        assert gate.entered.wait(10)
        t0 = time.monotonic()
        loaded = store.load(store.lookup(local[: C]))  # held locally: no round trip needed
        assert loaded.tokens == C and time.monotonic() - t0 < 2
        gate.open.set()
        probe.join(30)


def daemon_config(layout, tmp_path, **kw) -> CacheConfig:
    """A daemon's cache (no chunk shape of its own): DRAM for 4 chunks, SSD for 64."""
    return CacheConfig(host=HostTierConfig(4 * layout.chunk_bytes, extent_bytes=layout.chunk_bytes),
                       disk=DiskTierConfig(str(tmp_path), 64 * (header_len_for(layout.num_layers) + layout.chunk_bytes)),
                       **kw)


def save_as_a_daemon(cache: ChunkCache, shape: Shape, keys: list[ChunkKey]) -> None:
    """One sequence, chunk by chunk, as a daemon saves: reserve, fill, commit, touch."""
    for i, key in enumerate(keys):
        res = cache.reserve(key, shape, position=i, remaining=len(keys) - i)
        assert res is not Slot.HELD and res is not Slot.BUSY
        res.buffer.fill_(i)
        cache.commit(res, position=i)
        cache.touch([key], start=i)
    assert cache.flush()


def test_the_daemon_path_and_recovery_give_the_policy_every_chunks_position(layout, tmp_path):
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    config = daemon_config(layout, tmp_path, policy="cost", write_through=True)
    keys = [ChunkKey(bytes([i]) * 16) for i in range(12)]
    with ChunkCache(config) as cache:
        save_as_a_daemon(cache, shape, keys)
        policy = cache.placement.policies[0].inner  # (under the session hints' wrapper)
        assert all(math.isfinite(p) for p in policy._resident.values())
        assert math.isfinite(policy._inflation)
    with ChunkCache(config) as cache:  # restarted: every chunk comes back from SSD, ranked
        assert [cache.disk.position_of(k) for k in keys] == list(range(12))
        ssd_policy = cache.placement.policies[1].inner
        assert len(ssd_policy._resident) == 12
        assert all(math.isfinite(p) for p in ssd_policy._resident.values())
        assert [cache.index.position(k) for k in keys] == list(range(12))


def test_a_daemon_with_returns_demotes_what_dram_evicts_to_ssd(layout, tmp_path):
    """A daemon serves any model: its policies' compute model and chunk size are nominal (an 8B
    model on an accelerator, 16 MiB chunks), whose difference once judged a hit from SSD slower
    than a recompute and kept every chunk of an irregular session off SSD (none demoted, 42% of
    an agent benchmark's history recomputed). Guesses may order chunks, never refuse a tier."""
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    keys = [ChunkKey(bytes([i]) * 16) for i in range(12)]
    with ChunkCache(daemon_config(layout, tmp_path, policy="returns")) as cache:
        contexts = [p.inner._ctx for p in cache.placement.policies]
        assert not any(c.costs_known for c in contexts) and all(c.miss_saving_s(0) > 0 for c in contexts)
        save_as_a_daemon(cache, shape, keys)  # DRAM holds 4
        assert sum(cache.disk.position_of(k) is not None for k in keys) >= len(keys) - 4


def test_chunks_of_two_models_share_dram_and_one_takes_an_extent_from_the_other(layout, tmp_path):
    a = Shape(layout.chunk_bytes, layout.layer_bytes)  # 32 KiB chunks
    b = Shape(4 * layout.chunk_bytes, layout.layer_bytes)  # another model's: 128 KiB
    config = CacheConfig(host=HostTierConfig(8 * layout.chunk_bytes, extent_bytes=2 * layout.chunk_bytes),
                         disk=DiskTierConfig(str(tmp_path), 64 << 20))
    with ChunkCache(config) as cache:
        ka = [ChunkKey(b"a" + bytes([i]) * 15) for i in range(8)]
        for i, key in enumerate(ka):  # model A fills DRAM
            res = cache.reserve(key, a, position=i)
            res.buffer.fill_(i)
            cache.commit(res, position=i)
        cache.touch(ka)
        res = cache.reserve(ChunkKey(b"b" * 16), b, position=0)  # model B needs 2 whole extents
        res.buffer.fill_(77)
        assert cache.commit(res)
        snap = cache.snapshot()
        assert snap["tiers"]["host"]["chunks"] == 5 and snap["demotions"] == 4  # A's went down, kept
        for i, key in enumerate(ka):  # every chunk of A is still readable, from DRAM or SSD
            got = cache.read(key, lambda level, tier, key=key: tier.get(key), promote=False)
            assert got is not None and torch.equal(got[0], torch.full((a.nbytes,), i, dtype=torch.uint8))


def test_the_remote_level_forgets_chunks_another_instance_evicted(layout, valkey_standalone):
    prefix = unique_prefix()
    remote = RemoteConfig(ValkeyTierConfig((valkey_standalone.address,), 64 << 20, prefix=prefix), verify_s=0.0)
    tokens = list(range(2 * C))
    with store_of(layout, host_chunks=8, remote=remote) as a:
        a.save(tokens, make_kv(layout, 2 * C))
        assert a.flush(10)
        with KVStore(StoreConfig(model="tiny@1", layout=layout, host=HostTierConfig(8 * layout.chunk_bytes),
                                 remote=remote)) as b:
            hit = b.lookup(tokens)
            assert hit.tiers == ["valkey", "valkey"]
            for key in hit.keys:  # the other instance evicts them from the shared server
                a.cache.remote.delete(key)
            assert b.lookup(tokens).hit_tokens == 0  # not promised any more
            assert not any(b.index.holds(k, b.remote_level) for k in hit.keys)


def test_an_entry_goes_through_explicit_states_while_bytes_move(layout, tmp_path):
    from kvtier.store.config import EntryState

    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    config = CacheConfig(host=HostTierConfig(2 * layout.chunk_bytes), chunk=shape,
                         disk=DiskTierConfig(str(tmp_path), 64 * (header_len_for(layout.num_layers) + layout.chunk_bytes)))
    with ChunkCache(config) as cache:
        a, b, c = (ChunkKey(bytes([i]) * 16) for i in (1, 2, 3))
        res = cache.reserve(a, shape, position=0)
        assert cache.states(a) == {"host": EntryState.WRITING}
        assert cache.reserve(a, shape, position=0) is Slot.BUSY  # a second writer skips it
        cache.commit(res, position=0)
        assert cache.states(a) == {"host": EntryState.READABLE}
        held = cache.acquire([a])
        assert cache.states(a) == {"host": EntryState.READING}
        cache.release([h.key for h in held])
        for key in (b,):
            cache.commit(cache.reserve(key, shape, position=0), position=0)
        cache.touch([b])  # a is the least recent: the next save evicts it to SSD
        gate = Gate()
        disk = cache.disk
        disk.put = gate.wrap(disk.put)
        saver = threading.Thread(target=lambda: cache.commit(cache.reserve(c, shape, position=0), position=0))
        saver.start()
        assert gate.entered.wait(10)  # a's demotion is writing the SSD copy now, lock released
        assert cache.states(a) == {"host": EntryState.EVICTING}
        assert cache.contains(b) and cache.lookup_keys([a]).levels == [0]  # still readable meanwhile
        gate.open.set()
        saver.join(10)
        assert cache.states(a) == {"disk": EntryState.READABLE}
        assert cache.states(c) == {"host": EntryState.READABLE}


def _eio(monkeypatch):
    import errno
    import os

    real = os.preadv

    def failing(fd, bufs, pos):  # fault: a transient I/O error of the disk
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    return lambda: monkeypatch.setattr(os, "preadv", real)


def test_a_transient_ssd_error_is_a_miss_that_keeps_the_chunk_on_every_path(layout, tmp_path, monkeypatch):
    a = list(range(2 * C))
    kv = make_kv(layout, 2 * C, seed=1)
    with store_of(layout, host_chunks=2, tmp_path=tmp_path) as store:
        store.save(a, kv)
        store.save(list(range(500, 500 + 2 * C)), make_kv(layout, 2 * C, seed=2))  # a goes to SSD
        hit = store.lookup(a)
        assert hit.tiers == ["disk", "disk"]
        restore = _eio(monkeypatch)
        assert store.load(hit, promote=False).tokens == 0  # read in place: a miss...
        assert store.load(hit).tokens == 0  # ...and through a promotion: a miss
        restore()
        for key in hit.keys:  # ...that kept the chunks, in the tier and in the index
            assert store.cache.disk.contains(key) and 1 in store.index.levels(key)
        got = store.load(store.lookup(a))
        assert got.tokens == 2 * C
        for (gk, gv), (k, v) in zip(got.kv, kv):
            assert torch.equal(gk, k) and torch.equal(gv, v)


def _two_sizes(layout, tmp_path, disk_bytes: int = 64 << 20):
    a = Shape(layout.chunk_bytes, layout.layer_bytes)  # two to an extent
    b = Shape(2 * layout.chunk_bytes, layout.layer_bytes)  # a whole extent
    config = CacheConfig(host=HostTierConfig(4 * layout.chunk_bytes, extent_bytes=2 * layout.chunk_bytes),
                         disk=DiskTierConfig(str(tmp_path), disk_bytes))
    return a, b, config


def test_a_save_while_an_extent_drains_for_another_size_evicts_instead_of_failing(layout, tmp_path):
    a, b, config = _two_sizes(layout, tmp_path)
    with ChunkCache(config) as cache:
        ka = [ChunkKey(b"a" + bytes([i]) * 15) for i in range(4)]
        for i, key in enumerate(ka):  # size A fills both extents
            res = cache.reserve(key, a, position=i)
            res.buffer.fill_(i)
            cache.commit(res, position=i)
        cache.touch(ka)
        gate, real_put, calls = Gate(), cache.disk.put, []

        def put(*args, **kw):  # the drain's second demotion hangs
            calls.append(1)
            return (gate.wrap(real_put) if len(calls) == 2 else real_put)(*args, **kw)

        cache.disk.put = put
        big = threading.Thread(target=lambda: cache.commit(cache.reserve(ChunkKey(b"b" * 16), b, position=0)))
        big.start()
        assert gate.entered.wait(10)  # extent 0 drains: one slot free (not handed out), one leaving
        res = cache.reserve(ChunkKey(b"c" * 16), a, position=0)  # evicts from the other extent
        assert not isinstance(res, Slot)
        cache.commit(res, position=0)
        gate.open.set()
        big.join(10)
        assert not big.is_alive()


def test_an_ssd_eviction_during_a_dram_drain_does_not_end_the_drain(layout, tmp_path):
    from kvtier.tiers.disk_format import header_len_for as hlen

    a, b, config = _two_sizes(layout, tmp_path, disk_bytes=2 * (hlen(layout.num_layers) + layout.chunk_bytes))
    with ChunkCache(config) as cache:
        k = {n: ChunkKey(n.encode() * 16) for n in ("0", "1", "2", "3", "z")}
        for n in ("0", "1", "2", "3", "z"):  # the fifth pushes "0" down to SSD
            res = cache.reserve(k[n], a)
            res.buffer.fill_(1)
            cache.commit(res)
            cache.touch([k[n]])
        with cache._lock:
            cache.placement.demote(k["1"], 0)  # "1" on SSD too (as write-through leaves it)
        cache.touch([k["0"]])
        gate, real_put, seen = Gate(), cache.disk.put, {}

        def put(key, *args, **kw):
            if key == k["z"]:  # the drain's second demotion (it evicts "1" from the full SSD)
                seen["draining"] = set(cache.host._draining)
                return gate.wrap(real_put)(key, *args, **kw)
            return real_put(key, *args, **kw)

        cache.disk.put = put
        t = threading.Thread(target=lambda: cache.commit(cache.reserve(ChunkKey(b"b" * 16), b)))
        t.start()
        assert gate.entered.wait(10)
        gate.open.set()
        t.join(10)
        assert seen["draining"]  # still draining while its second chunk was demoted


def _dram_pinned_with_a_promotion_stuck(store, layout):
    """DRAM (4 chunks) holds 3 chunks pinned by readers and 1 slot taken by a promotion whose SSD
    read hangs. Returns (gate, loader thread, pinned keys)."""
    a = list(range(4 * C))
    store.save(a, make_kv(layout, 4 * C, seed=1))
    store.save(list(range(1000, 1000 + 4 * C)), make_kv(layout, 4 * C, seed=2))  # a -> SSD
    pinned = [k for k in store.keys_for(list(range(1000, 1000 + 4 * C)))[:3] if store.cache.pin_dram(k)]
    assert len(pinned) == 3
    gate = Gate()
    disk = store.cache.disk
    disk.get_into = gate.wrap(disk.get_into)
    hit = store.lookup(a)
    loader = threading.Thread(target=lambda: store.load(hit))  # promotes a[0] into the 4th slot
    loader.start()
    assert gate.entered.wait(10)
    return gate, loader, pinned


def test_a_save_with_no_room_does_not_wait_for_a_move_that_frees_nothing(layout, tmp_path):
    """An SSD -> DRAM promotion in flight frees no DRAM when it ends, so a save that finds no room
    is refused at once instead of waiting the room deadline for it."""
    with store_of(layout, host_chunks=4, tmp_path=tmp_path) as store:
        gate, loader, _ = _dram_pinned_with_a_promotion_stuck(store, layout)
        try:
            t0 = time.monotonic()
            res = store.save(list(range(2000, 2000 + C)), make_kv(layout, C, seed=3))
            took = time.monotonic() - t0
            assert res.stored == 0
            assert took < 1.0, f"a save with no room waited {took:.2f}s for a move that frees nothing"
        finally:
            gate.open.set()
            loader.join(30)


def test_a_release_that_makes_room_wakes_a_waiting_save(layout, tmp_path):
    """While the pins hold, a save waits (a DRAM copy-out is in flight). Readers releasing their
    pins after 0.2 s make room, and the waiting save must wake then, not at its deadline."""
    with store_of(layout, host_chunks=4, tmp_path=tmp_path) as store:
        gate, loader, pinned = _dram_pinned_with_a_promotion_stuck(store, layout)
        cache = store.cache
        try:
            # a DRAM copy-out in flight makes a save wait for room (it would free a pin)
            with cache._lock:
                cache.mover.in_flight += 1
            threading.Timer(0.2, lambda: cache.release(pinned)).start()
            t0 = time.monotonic()
            res = store.save(list(range(2000, 2000 + C)), make_kv(layout, C, seed=3))
            took = time.monotonic() - t0
            assert res.stored == 1
            assert took < 1.5, f"the save slept {took:.2f}s although room was free after 0.2 s"
        finally:
            with cache._lock:
                cache.mover.in_flight -= 1
            gate.open.set()
            loader.join(30)


def test_a_lookup_made_while_the_lock_is_held_counts_before_the_next_eviction(layout, tmp_path):
    """A lookup never waits for the lock: its touch is recorded by the next holder. A promotion
    that evicts must record it first, so LRU evicts the chunk nobody asked for (B), not A."""
    with store_of(layout, host_chunks=2, tmp_path=tmp_path, write_through=True) as store:
        ka = store.keys_for(list(range(C)))
        kb = store.keys_for(list(range(500, 500 + C)))
        kc = store.keys_for(list(range(900, 900 + C)))
        store.save(list(range(900, 900 + C)), make_kv(layout, C, seed=3))  # C
        store.save(list(range(C)), make_kv(layout, C, seed=1))  # A
        store.save(list(range(500, 500 + C)), make_kv(layout, C, seed=2))  # B; C now on SSD only
        store.flush()
        cache = store.cache
        assert cache.index.fastest(kc[0]) == 1 and cache.index.fastest(ka[0]) == 0
        holding, release = threading.Event(), threading.Event()

        def hold():
            with cache._lock:
                holding.set()
                release.wait(5)

        before = store.stats.lookups  # (takes the lock)
        t = threading.Thread(target=hold)
        t.start()
        assert holding.wait(5)
        assert store.lookup(list(range(C))).hit_tokens == C  # A is the most recently used now
        assert cache._lock.locked() and t.is_alive()  # so its touch was deferred
        release.set()
        t.join()
        assert store.stats.lookups == before + 1
        assert store.read_entry(kc[0]) is not None  # promotes C into DRAM: evicts the LRU chunk
        assert cache.index.holds(ka[0], 0) and not cache.index.holds(kb[0], 0)


def test_acquiring_a_key_twice_in_one_call_is_refused_and_pins_nothing(layout):
    """``acquire([k, k])`` used to pin k three times and hand out two entries, so the release
    of what it handed out left a pin behind for good: now it is refused before anything."""
    tokens = list(range(2 * C))
    with store_of(layout, host_chunks=4) as store:
        store.save(tokens, make_kv(layout, len(tokens)))
        k0, k1 = store.keys_for(tokens)
        cache = store.cache
        try:
            cache.acquire([k0, k1, k0])
        except ValueError as exc:
            assert "listed twice" in str(exc) and k0.hex() in str(exc)
        else:
            raise AssertionError("a duplicate key was acquired")
        assert not store.host.is_pinned(k0) and not store.host.is_pinned(k1)
        held = cache.acquire([k0, k1])
        cache.release([h.key for h in held])
        assert store.host.pin_total() == 0


def test_the_snapshot_counts_every_pin_beside_the_entries_pinned(layout):
    """``pinned``: entries pinned; ``pins``: every pin (a pin nests, and a leaked one shows
    as pins outgrowing what callers hold)."""
    tokens = list(range(2 * C))
    with store_of(layout, host_chunks=4) as store:
        store.save(tokens, make_kv(layout, len(tokens)))
        k0, k1 = store.keys_for(tokens)
        held = [store.cache.acquire([k0, k1]), store.cache.acquire([k0])]
        host = store.snapshot()["tiers"]["host"]
        assert (host["pinned"], host["pins"]) == (2, 3)
        for h in held:
            store.cache.release([x.key for x in h])
        host = store.snapshot()["tiers"]["host"]
        assert (host["pinned"], host["pins"]) == (0, 0)


def test_a_lookup_that_overtakes_its_queued_hint_is_the_same_use(layout):
    store = store_of(layout, 4)
    cache = store.cache
    seq = cache.arrived("r")  # the lookup, on its own connection, came first
    assert seq is not None and cache.arrived("r") == seq
    cache.queued("r", [], wait=True, prefetch=False)  # the hint finds it: not a second request
    assert cache.use_of("r") == seq
    cache.started("r")
    assert cache.use_of("r") == seq and cache.arrived(None) is None
    store.close()
