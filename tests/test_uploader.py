"""The store's background uploader into the remote tier, on a real Valkey server: batches,
chunks already there, a full tier, a server gone."""

import threading

import torch

from kvtier.tiers.valkey import ValkeyTier, ValkeyTierConfig
from kvtier.uploader import Uploader
from tests.remote_servers import unique_prefix

from .tiers.tier_contract import ENTRY, SEGMENT, data, key


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


def test_a_full_remote_tier_gives_up_its_oldest_chunks(valkey_standalone):
    tier = tier_on(valkey_standalone, entries=4)
    uploader = Uploader(tier, SEGMENT, max_queued=16)
    outcomes = {}
    try:
        for i in range(10):
            assert uploader.submit(key(i), data(i), lambda ok, i=i: outcomes.__setitem__(i, ok))
        assert uploader.flush(timeout=10)
        assert all(outcomes[i] for i in range(10)) and uploader.stats.evicted > 0
        assert key(9) in tier.keys() and len(tier.keys()) <= 4 and tier.used <= tier.capacity
        assert torch.equal(tier.get(key(9)), data(9))
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
