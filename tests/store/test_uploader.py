"""The store's background uploader into the remote tier, on a real Valkey server: batches,
chunks already there, a full tier (and a tenant's full prefix), a server gone."""

import threading

import torch

from kvtier.store.remote_level import make_remote
from kvtier.store.uploader import EVICT_BATCH, Uploader
from kvtier.tiers.valkey import ValkeyTier, ValkeyTierConfig
from tests.remote_servers import unique_prefix

from ..tiers.tier_contract import ENTRY, SEGMENT, data, key


def tier_on(server, entries: int = 16, **kw) -> ValkeyTier:
    kw.setdefault("timeout_s", 0.5)
    kw.setdefault("reconnect_interval_s", 0.2)
    capacity = entries * (ENTRY + 512)  # an entry and its header
    return ValkeyTier(ValkeyTierConfig((server.address,), capacity, prefix=unique_prefix(), **kw))


def batches_of(tier) -> list[int]:
    """Sizes of the put_many calls the tier gets (the real method runs)."""
    sizes: list[int] = []
    real = tier.put_many

    def wrapper(keys, *args, **kw):
        sizes.append(len(keys))
        return real(keys, *args, **kw)

    tier.put_many = wrapper
    return sizes


def test_queued_chunks_go_up_in_one_batch_and_chunks_already_there_are_not_sent(valkey_standalone):
    tier = tier_on(valkey_standalone)
    assert tier.put(key(3), data(3), SEGMENT)  # another instance uploaded it already
    sizes = batches_of(tier)
    uploader = Uploader(tier, SEGMENT, max_queued=16)
    entered, gate, outcomes = threading.Event(), threading.Event(), {}

    def done(i):
        def record(ok: bool) -> None:
            outcomes[i] = ok
            if i == 0:
                entered.set()
                gate.wait(10)  # the uploader thread waits here while more chunks queue up
        return record

    try:
        assert uploader.submit(key(0), data(0), done(0))
        assert entered.wait(10)  # chunk 0 went up alone; the next ones queue behind it
        for i in range(1, 6):
            assert uploader.submit(key(i), data(i), done(i))
        assert not uploader.submit(key(1), data(1), done(1))  # already queued
        gate.set()
        assert uploader.flush(timeout=10)
        assert outcomes == {i: True for i in range(6)}
        assert sizes == [1, 4]  # chunk 3 was not sent again
        assert uploader.stats.uploaded == 6 and uploader.stats.failed == 0
        for i in range(6):
            assert torch.equal(tier.get(key(i)), data(i))
    finally:
        uploader.close()
        tier.close()


def upload_all(uploader, ids, **kw) -> dict[int, bool]:
    """Submit chunks ``ids`` (each must be queued), wait for them: each one's outcome."""
    outcomes: dict[int, bool] = {}
    for i in ids:
        assert uploader.submit(key(i), data(i), lambda ok, i=i: outcomes.__setitem__(i, ok), **kw)
    assert uploader.flush(timeout=10)
    return outcomes


def test_a_full_remote_tier_gives_up_its_oldest_chunks(valkey_standalone):
    tier = tier_on(valkey_standalone, entries=4)
    uploader = Uploader(tier, SEGMENT, max_queued=16)
    try:
        outcomes = upload_all(uploader, range(10))
        assert all(outcomes[i] for i in range(10)) and uploader.stats.evicted > 0
        assert key(9) in tier.keys() and len(tier.keys()) <= 4 and tier.used <= tier.capacity
        assert torch.equal(tier.get(key(9)), data(9))
    finally:
        uploader.close()
        tier.close()


def observe_listing(tier) -> tuple[list[int], list[int]]:
    """Calls of ``keys`` (the whole index) and the ``n`` of each ``oldest`` call (the real
    methods run)."""
    listed: list[int] = []
    asked: list[int] = []
    keys, oldest = tier.keys, tier.oldest

    def observed_keys():
        listed.append(1)
        return keys()

    def observed_oldest(n):
        asked.append(n)
        return oldest(n)

    tier.keys, tier.oldest = observed_keys, observed_oldest
    return listed, asked


def test_making_room_in_the_full_tier_never_reads_its_whole_index(valkey_standalone):
    """The index may hold millions of chunks of every instance: the uploader asks for the few
    oldest it evicts (one bounded query), never for the whole index."""
    tier = tier_on(valkey_standalone, entries=4)
    for i in range(100, 104):  # another instance filled the tier
        assert tier.put(key(i), data(i), SEGMENT)
    listed, asked = observe_listing(tier)
    uploader = Uploader(tier, SEGMENT, max_queued=16)
    try:
        outcomes = upload_all(uploader, range(6))
        assert outcomes == {i: True for i in range(6)} and uploader.stats.evicted >= 4
        assert listed == [], "the uploader read the whole remote index to evict a few chunks"
        assert asked and set(asked) == {EVICT_BATCH}
        assert not any(tier.contains(key(i)) for i in range(100, 104))  # the oldest went first
    finally:
        uploader.close()
        tier.close()


def test_a_tenants_full_prefix_gives_up_its_own_oldest_chunks(valkey_standalone):
    """With ``tenant_prefixes`` each tenant has its own index and budget: a chunk of acme's
    that does not fit evicts acme's oldest (asked of acme's index, boundedly), never the
    shared prefix's chunks, and no index is read whole."""
    config = ValkeyTierConfig((valkey_standalone.address,), 4 * (ENTRY + 512), prefix=unique_prefix(),
                              tenant_prefixes=True, timeout_s=0.5)
    tier = make_remote(config, lambda k: "")
    shared, acme = tier.for_tenant(""), tier.for_tenant("acme")
    for i in range(100, 103):
        assert shared.put(key(i), data(i), SEGMENT)
    watched = [observe_listing(t) for t in (tier, shared, acme)]
    uploader = Uploader(tier, SEGMENT, max_queued=16)
    try:
        outcomes = upload_all(uploader, range(8), tenant="acme")
        assert outcomes == {i: True for i in range(8)} and uploader.stats.evicted > 0
        assert [len(listed) for listed, _ in watched] == [0, 0, 0]
        assert [bool(asked) for _, asked in watched] == [False, False, True]  # acme's own index
        assert shared.keys() == [key(i) for i in range(100, 103)]
        assert key(7) in acme.keys() and len(acme.keys()) <= 4
        assert tier.oldest(2) == [key(100), key(101)]  # the tenants' tiers in turn, shared first
        assert tier.oldest(5) == [key(100), key(101), key(102)] + acme.oldest(2)
        assert tier.pin(key(100)) and tier.pin(key(100))  # pins live in the tenant's own tier
        assert (tier.pinned_count(), tier.pin_total()) == (1, 2)
        tier.unpin(key(100))
        tier.unpin(key(100))
    finally:
        uploader.close()
        tier.close()


def test_uploads_to_a_server_gone_fail_and_are_counted(valkey_private):
    valkey_private.start()
    tier = tier_on(valkey_private)
    uploader = Uploader(tier, SEGMENT, max_queued=16)
    outcomes = {}
    try:
        valkey_private.stop()
        for i in range(3):
            assert uploader.submit(key(i), data(i), lambda ok, i=i: outcomes.__setitem__(i, ok))
        assert uploader.flush(timeout=20)
        assert outcomes == {0: False, 1: False, 2: False} and uploader.stats.failed == 3
        assert tier.stats.errors >= 1
    finally:
        uploader.close()
        tier.close()
