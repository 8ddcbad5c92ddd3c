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


@pytest.mark.parametrize("kw", [{"policy": "fifo"}, {"dram_chunks": 0}, {"ssd_chunks": -1}])
def test_bad_configs_are_refused(kw):
    with pytest.raises(ValueError):
        SimConfig(**kw)
