"""Write-through saves, told as stories: a save that returns says which of its chunks reached
SSD, and what it said is there after a restart.

The stores here are small on purpose: DRAM of a few chunks and a full SSD, so that every save
demotes (DRAM to SSD) and evicts (from SSD) while its own chunks are being written through --
the situation in which a chunk could be dropped from DRAM before its copy to SSD was made.
"""

import random
import threading

import torch

from kvtier import DiskTierConfig, HostTierConfig, KVStore, StoreConfig
from kvtier.tiers.disk_format import header_len_for

from ..conftest import make_kv

C = 16  # chunk tokens in the `layout` fixture


def config_of(layout, path, host_chunks: int, disk_chunks: int) -> StoreConfig:
    per = header_len_for(layout.num_layers) + layout.chunk_bytes
    return StoreConfig(model="tiny@1", layout=layout, host=HostTierConfig(host_chunks * layout.chunk_bytes),
                       disk=DiskTierConfig(str(path), disk_chunks * per), write_through=True)


class SsdLog:
    """A thin observer of the real SSD tier: the chunks that reached it (a put that stored
    them), those deleted from it (evicted) and those on it now (put, not deleted since)."""

    def __init__(self, store: KVStore) -> None:
        disk = store.cache.disk
        self.reached: set[bytes] = set()
        self.on_ssd: set[bytes] = set()
        self.deleted: set[bytes] = set()
        self._lock = threading.Lock()
        put, delete = disk.put, disk.delete

        def observed_put(key, *args, **kw):
            stored = put(key, *args, **kw)
            if stored:
                with self._lock:
                    self.reached.add(key)
                    self.on_ssd.add(key)
            return stored

        def observed_delete(key):
            removed = delete(key)
            if removed:
                with self._lock:
                    self.on_ssd.discard(key)
                    self.deleted.add(key)
            return removed

        disk.put, disk.delete = observed_put, observed_delete


def conversation(i: int) -> list[int]:
    chunks = random.Random(i).randint(2, 6)
    return [i * 10_000 + t for t in range(chunks * C)]


def check_save(store: KVStore, ssd: SsdLog, tokens: list[int], saved) -> list[bytes]:
    """The save's claims against what the SSD tier saw; the keys it said stored."""
    keys = store.keys_for(tokens)
    assert saved.present == 0 and saved.busy == 0  # conversations share nothing
    assert saved.stored + saved.dropped == len(keys)
    stored = keys[: saved.stored]  # a chunk that finds no room drops the rest of its sequence
    unpersisted = getattr(saved, "unpersisted", 0)
    never = [k for k in stored if k not in ssd.reached]
    assert len(never) <= unpersisted <= saved.stored, (
        f"{saved}: {len(never)} of its stored chunks never reached SSD")
    return stored


def test_chunks_that_ssd_cannot_take_are_counted_not_reported_stored_on_ssd(layout, tmp_path):
    """SSD is full of chunks someone is reading (pinned): nothing can be evicted there, so a
    new save's chunks stay in DRAM only, and the save says so."""
    a, b = list(range(4 * C)), list(range(500, 500 + 2 * C))
    kva, kvb = make_kv(layout, len(a), seed=1), make_kv(layout, len(b), seed=2)
    config = config_of(layout, tmp_path, host_chunks=8, disk_chunks=4)
    with KVStore(config) as store:
        saved = store.save(a, kva)
        assert (saved.stored, saved.unpersisted) == (4, 0)
        disk = store.cache.disk
        held = store.keys_for(a)
        for key in held:
            assert disk.pin(key)
        try:
            saved = store.save(b, kvb)
        finally:
            for key in held:
                disk.unpin(key)
        assert (saved.stored, saved.unpersisted, saved.dropped) == (2, 2, 0)
        assert store.lookup(b).tiers == ["host"] * 2  # stored: readable from DRAM
        assert not any(disk.contains(k) for k in store.keys_for(b))
    with KVStore(config) as store:  # a restart keeps what reached SSD, and only that
        assert store.lookup(b).hit_tokens == 0
        hit = store.lookup(a)
        assert hit.tiers == ["disk"] * 4
        for got, want in zip(store.load(hit).kv, kva):
            assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_many_saves_into_a_full_ssd_say_exactly_which_chunks_reached_it_and_a_restart_has_them(
        layout, tmp_path):
    """50 conversations through DRAM of 4 chunks and an SSD of 16: every chunk a save says
    stored and persisted reached SSD before the save returned, and after a restart every
    conversation still whole on SSD loads exactly (the old store said ``stored=6, dropped=0``
    for saves some chunk of which never reached SSD)."""
    config = config_of(layout, tmp_path, host_chunks=4, disk_chunks=16)
    claimed: dict[int, list[bytes]] = {}
    with KVStore(config) as store:
        ssd = SsdLog(store)
        for i in range(50):
            tokens = conversation(i)
            saved = store.save(tokens, make_kv(layout, len(tokens), seed=i))
            stored = check_save(store, ssd, tokens, saved)
            if saved.unpersisted == 0 and saved.dropped == 0:
                claimed[i] = stored
        on_ssd, evicted = set(ssd.on_ssd), set(ssd.deleted)
        assert on_ssd == {k for k in on_ssd if store.cache.index.holds(k, 1)}
    # said persisted, and not evicted from SSD since (or written there again)
    whole = [i for i, keys in claimed.items() if all(k in on_ssd or k not in evicted for k in keys)]
    assert whole  # the last few conversations at least
    said = {k for keys in claimed.values() for k in keys if k in on_ssd or k not in evicted}
    with KVStore(config) as store:
        assert {k for k in on_ssd if store.cache.index.holds(k, 1)} == on_ssd
        missing = [k for k in said if not store.cache.index.holds(k, 1)]
        assert not missing, f"{len(missing)} chunks said persisted (and never evicted) are not on SSD"
        for i in whole:
            tokens = conversation(i)
            hit = store.lookup(tokens)
            assert hit.hit_tokens == len(tokens), f"conversation {i} was said persisted"
            loaded = store.load(hit)
            assert loaded.tokens == len(tokens)
            for got, want in zip(loaded.kv, make_kv(layout, len(tokens), seed=i)):
                assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_concurrent_saves_into_a_full_ssd_never_overstate_what_reached_it(layout, tmp_path):
    """Four threads saving at once (demotions and write-throughs racing for the same SSD
    room): no save counts a chunk as persisted that never got to SSD."""
    config = config_of(layout, tmp_path, host_chunks=6, disk_chunks=12)
    errors: list[BaseException] = []
    with KVStore(config) as store:
        ssd = SsdLog(store)

        def saver(first: int) -> None:
            try:
                for i in range(first, 60, 4):
                    tokens = conversation(i)
                    saved = store.save(tokens, make_kv(layout, len(tokens), seed=i))
                    check_save(store, ssd, tokens, saved)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=saver, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
