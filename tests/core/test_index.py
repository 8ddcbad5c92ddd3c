from kvtier.core.index import ChunkIndex


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_chunk_can_live_in_several_tiers_and_the_fastest_wins():
    idx = ChunkIndex()
    idx.add(k(1), 1)
    assert idx.fastest(k(1)) == 1
    idx.add(k(1), 0)
    assert idx.fastest(k(1)) == 0 and idx.levels(k(1)) == [0, 1]
    idx.discard(k(1), 0)
    assert idx.fastest(k(1)) == 1 and idx.holds(k(1), 1) and not idx.holds(k(1), 0)
    idx.discard(k(1), 1)
    assert k(1) not in idx and idx.fastest(k(1)) is None and len(idx) == 0


def test_longest_prefix_stops_at_the_first_gap():
    idx = ChunkIndex()
    for i, level in [(0, 0), (1, 1), (2, 0), (4, 0)]:
        idx.add(k(i), level)
    hit = idx.longest_prefix([k(i) for i in range(5)])
    assert hit.keys == [k(0), k(1), k(2)]
    assert hit.levels == [0, 1, 0]
    assert len(idx.longest_prefix([k(3), k(4)])) == 0
    assert idx.count(0) == 3 and idx.count(1) == 1
