"""The placement policies told as small stories: what each keeps, and why."""

import random

import pytest

from kvtier.bench.simstore import SimConfig, SimStore
from kvtier.core.cost_model import ComputeModel
from kvtier.core.policies.base import TierContext
from kvtier.core.policy import (
    POLICIES,
    AttentionStorePolicy,
    CostPolicy,
    OptimalPolicy,
    make_policy,
)


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def drain(policy) -> list[bytes]:
    order = []
    while (v := policy.victim(lambda key: True)) is not None:
        order.append(v)
        policy.remove(v)
    return order


def test_registry_lists_the_baselines_first_and_builds_every_policy_from_a_tier_context():
    assert list(POLICIES) == ["lru", "fifo", "attentionstore", "cost", "returns", "optimal", "clairvoyant"]
    ctx = TierContext(future={k(1): [3]})
    for name in POLICIES:
        assert len(make_policy(name, ctx)) == 0


@pytest.mark.parametrize("name", ["optimal", "clairvoyant"])
def test_offline_bounds_refuse_to_run_without_the_future(name):
    with pytest.raises(ValueError, match="needs the whole future"):
        make_policy(name)


def test_clairvoyant_evicts_the_least_saving_per_request_until_next_use():
    ctx = TierContext(chunk_load_s=0.0, future={k(0): [10], k(1): [2], k(2): [20], k(3): [3]})
    p = make_policy("clairvoyant", ctx)
    p.begin(0, 0.0)
    for i in range(5):
        p.insert(k(i))
    p.touch([k(0)], cost_s=1.0)  # 1 s in 10 requests: 0.1 s per request
    p.touch([k(1)], cost_s=0.1)  # 0.05
    p.touch([k(2)], cost_s=4.0)  # 0.2
    p.touch([k(3)], cost_s=0.45)  # 0.15
    assert not p.admit(k(4), None)  # never used again: not admitted, and the first to go
    assert drain(p) == [k(4), k(1), k(0), k(3), k(2)]  # Belady would keep k(1) and drop k(2)


def test_clairvoyant_drops_a_sequence_from_its_end():
    ctx = TierContext(future={k(i): [5] for i in range(3)} | {k(9): [4]})
    p = make_policy("clairvoyant", ctx)
    p.begin(0, 0.0)
    for i in (0, 1, 2, 9):
        p.insert(k(i))
    p.touch([k(0), k(1), k(2)])  # a prompt: all three are needed again at request 5
    p.touch([k(9)])
    assert drain(p)[:3] == [k(2), k(1), k(0)]  # deepest first: a prefix never goes before its tail


def test_attentionstore_evicts_what_no_queued_request_needs_then_the_farthest_needed():
    p = AttentionStorePolicy()
    for i in range(4):
        p.insert(k(i))
    p.touch([k(0), k(1), k(2), k(3)])  # LRU alone would evict 3, 2, 1, 0
    p.hint(5, [k(3)])
    p.hint(6, [k(2)])
    assert drain(p) == [k(1), k(0), k(2), k(3)]


def test_attentionstore_forgets_a_request_once_it_is_served():
    p = AttentionStorePolicy()
    p.insert(k(0))
    p.insert(k(1))
    p.hint(1, [k(0)])
    assert p.victim(lambda key: True) == k(1)
    p.begin(1, now=0.0)
    assert p.victim(lambda key: True) == k(0)


def _scan_victim(order: list, window, evictable) -> bytes | None:
    """AttentionStore's rule by a plain scan of LRU order (the oracle)."""
    farthest, farthest_seq = None, -1
    for key in order:
        if not evictable(key):
            continue
        need = window.next_need(key)
        if need is None:
            return key
        if need > farthest_seq:
            farthest, farthest_seq = key, need
    return farthest


@pytest.mark.parametrize("seed", range(6))
def test_attentionstore_heaps_pick_the_victim_a_scan_of_lru_order_picks(seed):
    # Random inserts, touches, removals, hints, begins and pins: the heaps must name exactly the
    # chunk the rule, read off LRU order by a scan, names.
    rng = random.Random(seed)
    p = AttentionStorePolicy()
    held: list[bytes] = []
    pinned: set[bytes] = set()
    queued = served = 0
    for _ in range(4000):
        op = rng.random()
        if op < 0.25:
            key = k(rng.randrange(60))
            p.insert(key)  # a key already held is inserted again, as a recovered chunk is
            if key not in held:
                held.append(key)
        elif op < 0.45 and held:
            p.touch(rng.sample(held, rng.randint(1, min(6, len(held)))))
        elif op < 0.55 and held:
            key = held.pop(rng.randrange(len(held)))
            p.remove(key)
            pinned.discard(key)
        elif op < 0.7:
            queued += 1  # mostly in order; now and then late, or a number heard before
            seq = queued if rng.random() < 0.8 else rng.randint(1, queued)
            p.hint(seq, [k(rng.randrange(70)) for _ in range(rng.randint(1, 5))])
        elif op < 0.78:
            served = rng.randint(served + 1, max(served, queued) + 2)  # sometimes one never hinted
            p.begin(served, now=0.0)
        elif op < 0.8:
            p._rebuild()
        elif op < 0.85 and held:
            pinned ^= {rng.choice(held)}
        else:
            evictable = frozenset(held) - pinned
            evictable = evictable.__contains__
            assert p.victim(evictable) == _scan_victim(list(p._order), p._window, evictable)
    while held:  # and down to the last chunk
        victim = p.victim(lambda key: True)
        assert victim == _scan_victim(list(p._order), p._window, lambda key: True)
        p.remove(victim)
        held.remove(victim)
    assert p.victim(lambda key: True) is None


def test_optimal_evicts_the_chunk_needed_farthest_away_and_never_admits_a_dead_one():
    future = {k(0): [0, 1], k(1): [0, 5], k(2): [0, 3]}
    p = OptimalPolicy(TierContext(future=future))
    p.begin(0, now=0.0)
    for i in range(3):
        p.insert(k(i))
    p.touch([k(0), k(1), k(2)])
    assert drain(p) == [k(1), k(2), k(0)]
    assert p.admit(k(2), 0) and not p.admit(k(9), 0)


def test_cost_keeps_the_chunks_that_get_reused_over_one_off_ones():
    # A shared system prompt (chunk 0) is reused by every request; each request's own last
    # chunk never is. After some traffic the policy has learned that, so under pressure the
    # one-offs go first even though the shared chunk was touched less recently.
    p = CostPolicy(TierContext())
    for seq in range(50):
        p.begin(seq, now=float(seq))
        own = k(1000 + seq)
        p.insert(own) if seq else None
        if seq == 0:
            p.insert(k(0))
        p.touch([k(0), own])
    p.begin(50, now=50.0)
    p.insert(k(2000))
    p.touch([k(2000)])  # a newer one-off, never followed by anything
    assert p.victim(lambda key: True) != k(0)
    order = drain(p)
    assert order[-1] == k(0)


def test_cost_values_a_deep_chunk_by_its_recompute_cost():
    model = ComputeModel()
    assert model.chunk_recompute_s(100, 512) > 2 * model.chunk_recompute_s(0, 512)
    ctx = TierContext(level=1, chunk_load_s=model.chunk_recompute_s(0, 512))
    assert ctx.miss_saving_s(0) == 0.0 and ctx.miss_saving_s(100) > 0


def test_cost_never_evicts_a_chunk_before_a_later_chunk_of_the_same_sequence():
    p = CostPolicy(TierContext())
    keys = [k(i) for i in range(6)]
    for key in keys:
        p.insert(key)
    p.touch(keys)
    assert drain(p) == list(reversed(keys))


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_runs_the_store_placement_and_respects_capacity(name):
    requests = [[k(i) for i in range(s, s + 4)] for s in range(0, 40, 2)] * 2
    future: dict[bytes, list[int]] = {}
    for seq, keys in enumerate(requests):
        for key in keys:
            future.setdefault(key, []).append(seq)
    contexts = [TierContext(level=0, future=future), TierContext(level=1, future=future)]
    place = SimStore(SimConfig(name, dram_chunks=6, ssd_chunks=10), contexts)
    for seq, keys in enumerate(requests):
        place.begin(seq, float(seq))
        if place.lookahead and seq + 1 < len(requests):
            place.hint(seq + 1, requests[seq + 1])
            place.prefetch(requests[seq + 1])
        place.load(place.lookup(keys))
        place.save(keys)
        used, index = place.mover.used, place.placement.index
        assert used == [index.count(0), index.count(1)]
        assert used[0] <= 6 and used[1] <= 10
        assert [len(p) for p in place.placement.policies] == used


def test_cost_handles_a_call_with_more_keys_than_it_remembers(monkeypatch):
    import kvtier.core.policies.cost as cost_module
    from kvtier.core.policies.cost import CostPolicy

    monkeypatch.setattr(cost_module, "MAX_GHOSTS", 8)  # as if one call touched more than 2^20 keys
    policy = CostPolicy()
    keys = [bytes([i % 256, i // 256]) * 8 for i in range(100)]
    for k in keys[:3]:
        policy.insert(k)
    policy.touch(keys)  # used to raise KeyError: the ghosts of this very call were forgotten
    policy.touch(keys[:50])
    assert policy.victim(lambda k: True) in keys[:3]


def test_cost_never_lets_an_untouched_chunk_inflate_every_priority():
    import math

    from kvtier.core.policies.cost import CostPolicy

    policy = CostPolicy()
    fresh = [bytes([i]) * 16 for i in range(4)]
    for k in fresh:  # inserted, never touched (a daemon path without touches, before the fix)
        policy.insert(k)
    assert policy.victim(lambda k: True) in fresh
    assert math.isfinite(policy._inflation)
    old = bytes([9]) * 16
    policy.insert(old)
    policy.touch([old])
    assert math.isfinite(policy._resident[old])


def test_the_queue_window_reports_every_key_whose_next_need_changes():
    from kvtier.core.policies.window import QueueWindow

    w = QueueWindow()
    assert w.join(3, [k(1), k(2), k(1)]) == [k(1), k(2)]  # needed by nobody before
    assert w.join(5, [k(2), k(3)]) == [k(3)]
    assert w.join(3, [k(9)]) == []  # a request already queued
    assert w.next_need(k(2)) == 3
    assert sorted(w.leave_through(3)) == sorted([k(1), k(2)])  # k1: none now; k2: 3 -> 5
    assert w.next_need(k(1)) is None and w.next_need(k(2)) == 5
    assert w.join(4, [k(3)]) == []  # late: k3 still waits for request 5 first
    assert sorted(w.leave_through(10)) == sorted([k(2), k(3)])
    assert len(w) == 0 and w.next_need(k(3)) is None
