"""``fifo`` told as small stories: it forgets in the order things arrived, whatever is reused."""

import json

from click.testing import CliRunner

from kvtier.bench.replay import replay
from kvtier.bench.replay_config import ReplayConfig
from kvtier.bench.simstore import SimConfig, SimStore
from kvtier.bench.trace import parse_trace
from kvtier.cli import main
from kvtier.core.policies.base import TierContext
from kvtier.core.policy import LIVE_POLICIES, POLICIES, FIFOPolicy, LRUPolicy, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_fifo_evicts_the_oldest_inserted_even_right_after_a_hit_while_lru_keeps_it():
    fifo, lru = FIFOPolicy(), LRUPolicy()
    for p in (fifo, lru):
        for i in range(3):
            p.insert(k(i))
            p.touch([k(i)])  # the store touches what it saves
        p.touch([k(0)])  # chunk 0, the first in, is hit
    assert fifo.victim(lambda key: True) == k(0)  # first in, first out: the hit changes nothing
    assert lru.victim(lambda key: True) == k(1)  # lru keeps the chunk just used


def test_fifo_drops_a_saved_sequence_from_its_end_and_never_reorders_it_on_a_hit():
    p = FIFOPolicy()
    first, second = [k(0), k(1), k(2)], [k(10), k(11)]
    for keys in (first, second):
        for key in keys:
            p.insert(key)
        p.touch(keys)  # one save: its chunks arrived together, the deepest goes first
    p.touch(first)  # a hit on the whole first sequence: still the oldest
    order = []
    while (v := p.victim(lambda key: True)) is not None:
        order.append(v)
        p.remove(v)
    assert order == [k(2), k(1), k(0), k(11), k(10)]


def test_a_chunk_inserted_again_keeps_its_place_and_victim_skips_the_pinned():
    p = FIFOPolicy()
    for i in range(3):
        p.insert(k(i))
    p.insert(k(0))
    assert len(p) == 3
    assert p.victim(lambda key: key != k(0)) == k(1)
    p.remove(k(1))
    p.remove(k(99))  # absent: no error
    assert p.victim(lambda key: False) is None and len(p) == 2


def test_fifo_is_registered_and_runs_live():
    assert isinstance(make_policy("fifo"), FIFOPolicy)
    assert "fifo" in POLICIES and "fifo" in LIVE_POLICIES
    place = SimStore(SimConfig("fifo", dram_chunks=4, ssd_chunks=4),
                     [TierContext(level=0), TierContext(level=1)])
    for seq in range(6):
        keys = [k(10 * (seq % 3) + i) for i in range(3)]
        place.begin(seq, float(seq))
        place.load(place.lookup(keys))
        place.save(keys)
        assert place.mover.used[0] <= 4 and place.mover.used[1] <= 4


def _trace_lines() -> list[str]:
    # Every prompt opens with the same block 1, then a block of its own; DRAM holds 3 blocks.
    rows = [(t, [1, 10 + t]) for t in range(8)]
    return [json.dumps({"timestamp": 1000 * t, "input_length": 512 * len(ids), "output_length": 1,
                        "hash_ids": ids}) for t, ids in rows]


def test_replay_runs_with_fifo_which_loses_the_shared_block_that_lru_keeps():
    trace = parse_trace(_trace_lines())
    fifo = replay(trace, ReplayConfig(policy="fifo", dram_blocks=3))
    lru = replay(trace, ReplayConfig(policy="lru", dram_blocks=3))
    assert fifo.policy == "fifo" and fifo.requests == 8
    assert lru.hit_ratio_blocks == 7 / 16  # block 1 hits on every prompt after the first
    # FIFO pushes block 1 out when its turn comes, hits notwithstanding: the fifth prompt misses.
    assert fifo.hit_ratio_blocks == 6 / 16


def test_kvtier_replay_accepts_policy_fifo(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(_trace_lines()) + "\n")
    result = CliRunner().invoke(main, ["replay", str(path), "--policy", "fifo", "--dram-blocks", "3",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert "fifo" in result.output
