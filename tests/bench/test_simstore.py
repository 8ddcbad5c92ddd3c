"""The store's placement rules without bytes: demote on eviction, promote on a hit."""

import pytest

from kvtier.bench.simstore import SimConfig, SimStore


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_full_dram_demotes_to_ssd_and_a_later_hit_promotes_back():
    place = SimStore(SimConfig("lru", dram_chunks=2, ssd_chunks=4))
    place.save([k(0), k(1)])
    place.save([k(2), k(3)])  # DRAM holds 2: the first conversation goes to SSD
    assert place.placement.index.levels(k(0)) == [1]
    hit = place.lookup([k(0), k(1), k(9)])
    assert len(hit) == 2 and hit.levels == [1, 1]
    assert place.load(hit) == [1, 1]  # read from SSD...
    assert place.placement.index.levels(k(0)) == [0, 1]  # ...and now in DRAM too, SSD copy kept
    assert place.placement.stats.promotions == 2 and place.hits == [0, 2]
    assert place.placement.stats.writes_down == [0, 4]  # 0 and 1, then 2 and 3 to make room for them


def test_without_ssd_an_eviction_is_a_drop():
    place = SimStore(SimConfig("lru", dram_chunks=2))
    place.save([k(0), k(1), k(2)])
    assert k(0) not in place.placement.index and place.placement.stats.evictions == [1]
    assert place.placement.stats.writes_down == [0]


def test_prefetch_brings_a_queued_request_into_dram_and_is_counted_when_it_hits():
    place = SimStore(SimConfig("attentionstore", dram_chunks=2, ssd_chunks=4))
    place.save([k(0), k(1)])
    place.save([k(2), k(3)])
    assert place.prefetch([k(0), k(1), k(7)]) == 2
    place.load(place.lookup([k(0), k(1)]))
    assert place.hits == [2, 0]
    assert (place.placement.stats.prefetched, place.placement.stats.prefetch_hits) == (2, 2)


def test_a_run_held_in_one_tier_is_promoted_in_one_batch_when_dram_takes_it_whole():
    place = SimStore(SimConfig("lru", dram_chunks=3, ssd_chunks=8))
    place.save([k(0), k(1), k(2)])
    place.save([k(3), k(4), k(5)])  # 0, 1, 2 go down to SSD
    batches: list[int] = []
    real = place.mover.copy_many
    place.mover.copy_many = lambda moves: batches.append(len(moves)) or real(moves)
    assert place.prefetch([k(0), k(1), k(2), k(9)]) == 3
    assert batches == [3] and place.placement.stats.promotions == 3
    assert all(place.placement.index.fastest(k(i)) == 0 for i in range(3))
    # a run DRAM cannot take whole: one chunk after the other (each evicting the one before)
    place.save([k(6), k(7), k(8)])
    batches.clear()
    assert place.placement.promote_prefix([k(i) for i in range(6)]) >= 3
    assert batches == [] and place.placement.stats.promotions > 3  # 6 do not fit: one by one
    # only the runs of one tier, only whole: nothing to do when DRAM cannot take the run
    small = SimStore(SimConfig("lru", dram_chunks=2, ssd_chunks=8))
    for i in range(0, 6, 2):
        small.save([k(i), k(i + 1)])
    assert small.placement.promote_prefix([k(i) for i in range(4)], level=1) == 0
    assert small.placement.stats.promotions == 0 and small.placement.index.fastest(k(0)) == 1


def test_a_promotion_with_a_deadline_begins_no_run_after_it():
    """The daemon's acquire promotes a hit's remote run within the client's budget: a slow tier
    below must not hold the answer past it (runs already begun finish; none starts after)."""
    import time

    place = SimStore(SimConfig("lru", dram_chunks=4, ssd_chunks=8))
    place.save([k(0), k(1), k(2), k(3)])
    place.save([k(4), k(5), k(6), k(7)])  # 0-3 go down to SSD
    batches: list[int] = []
    real = place.mover.copy_many
    place.mover.copy_many = lambda moves: batches.append(len(moves)) or real(moves)
    keys = [k(i) for i in range(4)]
    assert place.placement.promote_prefix(keys, level=1, batch=2, deadline=time.monotonic() - 1) == 0
    assert batches == [] and place.placement.index.fastest(k(0)) == 1
    assert place.placement.promote_prefix(keys, level=1, batch=2, deadline=time.monotonic() + 60) == 4
    assert batches == [2, 2]


@pytest.mark.parametrize("kw", [{"policy": "mru"}, {"dram_chunks": 0}, {"ssd_chunks": -1}])
def test_bad_configs_are_refused(kw):
    with pytest.raises(ValueError):
        SimConfig(**kw)
