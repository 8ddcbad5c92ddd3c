"""The ``returns`` policy told as small stories: sessions found without ids, return times
learned, the farthest return evicted, a session staged shortly before it comes back."""

import pytest

from kvtier import DiskTierConfig, HostTierConfig, KVStore, StoreConfig
from kvtier.core.cost_model import ComputeModel
from kvtier.core.layout import KVLayout
from kvtier.core.policies.base import TierContext
from kvtier.core.policies.returns import ReturnsPolicy
from kvtier.core.policy import LIVE_POLICIES, make_policy
from kvtier.tiers.disk_format import header_len_for

from ..conftest import make_kv
from .test_policies import drain


def k(*name: int) -> bytes:
    return bytes(name).ljust(16, b"\0")


def seq(session: int, n: int) -> list[bytes]:
    """The first ``n`` chunks of conversation ``session``."""
    return [k(session, i) for i in range(n)]


class Driver:
    """Requests served one after the other: ``begin``, then the touch of the request's save
    (a store inserts the chunks it saves, then touches the sequence)."""

    def __init__(self, policy: ReturnsPolicy) -> None:
        self.policy, self.seq = policy, 0

    def serve(self, now: float, keys: list[bytes]) -> None:
        self.begin(now)
        for i, key in enumerate(keys):
            self.policy.insert(key, i)
        self.policy.touch(keys)

    def begin(self, now: float) -> None:
        self.policy.begin(self.seq, now)
        self.seq += 1

    def save(self, keys: list[bytes]) -> None:
        """Another save of the request being served (its reply's blocks)."""
        for i, key in enumerate(keys):
            self.policy.insert(key, i)
        self.policy.touch(keys)


def test_returns_is_a_live_policy_built_from_the_registry():
    assert "returns" in LIVE_POLICIES
    assert isinstance(make_policy("returns"), ReturnsPolicy)


def test_a_session_back_every_ten_seconds_is_kept_over_one_last_seen_long_ago():
    p = ReturnsPolicy()
    d = Driver(p)
    d.serve(1.0, seq(2, 3))  # B: seen once, long ago
    for turn, t in enumerate((0.0, 10.0, 20.0, 30.0, 40.0)):  # A: a turn every 10 s, one more chunk each
        d.serve(t + 2, seq(1, 2 + turn))
    # A was used last; a policy ordering by predicted return alone would evict A (due at 52)
    # before B (due 10 s after t=1). But B is overdue far past the gap learned: it is over.
    order = drain(p)
    assert order[:3] == list(reversed(seq(2, 3)))
    assert order[3:] == list(reversed(seq(1, 6)))  # then A, its deepest chunk first


def test_a_session_overdue_far_past_its_gap_goes_before_one_idle_longer_within_its_own():
    p = ReturnsPolicy()
    d = Driver(p)
    for t in (0.0, 100.0, 200.0):  # X: a turn every 100 s
        d.serve(t, seq(1, 2))
    for t in (220.0, 225.0, 230.0, 235.0):  # Y: a turn every 5 s
        d.serve(t, seq(2, 2))
    d.begin(260.0)  # X idle 60 s but due at ~280; Y idle 25 s, five of its gaps
    assert drain(p) == [k(2, 1), k(2, 0), k(1, 1), k(1, 0)]  # LRU would evict X first


def test_the_deepest_chunk_of_a_session_goes_first_and_a_chunk_the_latest_turn_dropped_before_it():
    p = ReturnsPolicy()
    d = Driver(p)
    first = [k(1, 0), k(1, 1), k(9, 9)]  # the last block is partial: the next prompt re-keys it
    d.serve(0.0, first)
    d.serve(10.0, [k(1, 0), k(1, 1), k(1, 2), k(1, 3)])
    assert drain(p) == [k(9, 9), k(1, 3), k(1, 2), k(1, 1), k(1, 0)]


def test_a_partial_block_the_reply_re_keys_goes_before_every_other_session():
    p = ReturnsPolicy()
    d = Driver(p)
    d.serve(0.0, seq(5, 3))  # another conversation, idle since long before
    d.serve(50.0, [k(1, 0), k(1, 1), k(9, 9)])  # the prompt's last block is partial
    d.save([k(1, 0), k(1, 1), k(1, 2), k(1, 3)])  # the reply completes it: re-keyed
    order = drain(p)
    assert order[0] == k(9, 9)  # dead: before the idle conversation's chunks
    assert order.index(k(5, 0)) < order.index(k(1, 0))  # the rest as before


def test_a_superseded_block_is_not_written_to_a_lower_tier_unless_touched_again():
    p = ReturnsPolicy(TierContext(level=1, chunk_load_s=0.0))
    d = Driver(p)
    d.serve(0.0, [k(1, 0), k(1, 1), k(9, 9)])
    d.save([k(1, 0), k(1, 1), k(1, 2), k(1, 3)])
    assert not p.admit(k(9, 9), 2) and p.admit(k(1, 1), 1)
    d.serve(20.0, [k(1, 0), k(1, 1), k(9, 9)])  # the same prompt again: live once more
    d.begin(21.0)  # (a prompt seen before counts as a use once no extension followed)
    assert p.admit(k(9, 9), 2)


@pytest.mark.parametrize("second", [[k(2, 9)], [k(2, 9), k(2, 10)]])
def test_another_session_sharing_the_prefix_does_not_supersede_the_first_ones_last_block(second):
    # Without session ids two questions about one document look like one session when the
    # second arrives: its chunk at that position is not a re-key, whatever its length.
    p = ReturnsPolicy()
    d = Driver(p)
    d.serve(0.0, seq(5, 2))
    doc = [k(0, 0), k(0, 1)]
    d.serve(100.0, doc + [k(1, 9)])
    d.serve(101.0, doc + second)
    assert drain(p)[:2] == [k(5, 1), k(5, 0)]  # the idle conversation first, not a question


def test_sessions_are_told_apart_without_ids_though_they_share_a_system_prompt():
    p = ReturnsPolicy()
    d = Driver(p)
    system = [k(0, 0), k(0, 1)]
    alice = system + [k(1, 2), k(1, 3)]
    bob = system + [k(2, 2), k(2, 3)]
    d.serve(0.0, alice + [k(1, 99)])  # the partial last block: the next turn does not repeat it
    d.serve(1.0, bob)
    d.serve(10.0, alice + [k(1, 4), k(1, 5)])  # holds alice's deepest full key: her next turn
    d.serve(13.0, bob + [k(2, 4)])
    d.serve(20.0, alice + [k(1, 4), k(1, 5), k(1, 6)])
    sessions = sorted(p._sessions.values(), key=lambda g: g.sid)
    assert [(g.uses, g.gaps) for g in sessions] == [(3, 2), (2, 1)]
    assert [round(g.gap_sum / g.gaps, 6) for g in sessions] == [10.0, 12.0]
    # the system prompt belongs to neither: it is a group of its own, used by both
    assert all(not p._meta[key].group.session for key in system)
    assert p._meta[k(1, 2)].group is sessions[0] and p._meta[k(2, 2)].group is sessions[1]


def serve(p: ReturnsPolicy, request: int, now: float, keys: list[bytes]) -> None:
    """Request ``request`` begins at ``now`` and saves ``keys``, its touches naming it."""
    p.begin(request, now)
    for i, key in enumerate(keys):
        p.insert(key, i)
    p.touch(keys, use=request)


def queued_turns(p: ReturnsPolicy, hooks: bool) -> ReturnsPolicy:
    """Conversation 1 answers each reply after exactly 10 s, then waits behind a queue that
    changes (0, 40, 5, 70 s) before it is served; its request takes 1 s. ``hooks``: the
    scheduler says when each request arrived and when its reply was done."""
    t = 0.0
    for turn, wait in enumerate((0.0, 40.0, 5.0, 70.0)):
        keys = seq(1, 2 + turn)
        if hooks:
            p.hint(turn, keys)
            p.arrived(turn, keys, t)
        serve(p, turn, t + wait, keys)
        t += wait + 1.0
        if hooks:
            p.finished(turn, t)
        t += 10.0  # the user reads, thinks and answers
    return p


def test_a_session_learns_its_think_time_from_reply_to_next_arrival_not_from_its_queueing():
    g = queued_turns(ReturnsPolicy(), hooks=True)._sessions[0]
    assert g.gaps == 3 and g.gap_sum == pytest.approx(30.0)  # 10 s each: the think time proper
    assert g.regular and g.gap == pytest.approx(10.0)
    assert g.anchor == 149.0 and g.due == pytest.approx(159.0)  # expected 10 s after its last reply
    assert g.over < 160.5  # fixed think times: over soon after it is due, counted from the reply
    # From request starts alone the same turns look 51, 16 and 81 s apart: queueing, not the user.
    g = queued_turns(ReturnsPolicy(), hooks=False)._sessions[0]
    assert g.gap_sum == pytest.approx(148.0) and not g.regular


def test_a_think_time_counts_once_from_the_first_arrival_and_only_for_its_own_request():
    p = ReturnsPolicy()
    serve(p, 0, 0.0, seq(1, 2))
    p.finished(0, 2.0)
    p.hint(1, seq(1, 3))
    p.arrived(1, seq(1, 3), 12.0)
    p.hint(1, seq(1, 3))  # announced again later: the first arrival counts
    p.arrived(1, seq(1, 3), 30.0)
    p.begin(1, 40.0)
    p.touch(seq(1, 3), use=1)
    g = p._sessions[0]
    assert g.gaps == 1 and g.gap_sum == pytest.approx(10.0)
    p.finished(1, 41.0)
    p.hint(2, seq(1, 4))
    p.arrived(2, seq(1, 4), 40.5)  # before the reply it answers was done: no think time
    p.begin(2, 50.0)
    p.touch(seq(1, 4), use=2)
    assert g.gaps == 2 and g.gap_sum == pytest.approx(20.0)  # 10 s from the previous start
    p.finished(2, 51.0)
    p.hint(3, seq(1, 5))
    p.arrived(3, seq(1, 5), 61.0)  # 10 s after the reply: a sample for request 3 only
    p.begin(4, 70.0)  # another request uses the session first (3 was dropped)
    p.touch(seq(1, 5), use=4)
    assert g.gaps == 3 and g.gap_sum == pytest.approx(40.0)  # 20 s, from the start, not 10
    assert g.think is None


def test_a_long_reply_moves_when_a_session_is_over_and_it_is_not_counted_over_before_that():
    p = ReturnsPolicy()
    serve(p, 0, 0.0, seq(1, 2))
    g = p._sessions[0]
    over_from_start = g.over
    p.finished(0, 50.0)  # the reply took 50 s: the user starts thinking only then
    assert g.over == pytest.approx(over_from_start + 50.0)
    p.begin(1, over_from_start + 10.0)
    assert g.ended == -1  # not over yet: no "never came back" counted for its class
    p.begin(2, g.over + 1.0)
    assert g.ended == g.uses


def regular_session_then_staged(p: ReturnsPolicy, d: Driver) -> None:
    """A turn of conversation 1 every 10 s (t = 0 ... 30), its chunks then evicted to SSD."""
    for turn, t in enumerate((0.0, 10.0, 20.0, 30.0)):
        d.serve(t, seq(1, 2 + turn))
    for key in seq(1, 5):
        p.remove(key)


def test_a_session_is_staged_shortly_before_its_predicted_return_and_only_once():
    p = ReturnsPolicy()
    d = Driver(p)
    regular_session_then_staged(p, d)
    d.serve(32.0, seq(2, 6))
    assert p.staging(32.0) == []  # due at 40: not yet within its lead (half its gap)
    d.serve(36.0, seq(3, 6))  # a new conversation, just used: due later than conversation 1
    assert [list(s) for s in p.staging(36.0)] == [seq(1, 5)]
    for i, key in enumerate(seq(1, 5)):  # the store prefetches it: promoted, then touched
        p.insert(key, i)
    p.touch(seq(1, 5))
    d.serve(37.0, seq(4, 2))
    assert p.staging(37.0) == []  # not twice
    d.begin(40.0)
    p.touch(seq(1, 5))  # it comes back: its lookup hits, its save extends it
    p.touch(seq(1, 6))
    assert p._sessions[0].uses == 5 and p._sessions[0].gaps == 4  # the staging was no use


def test_nothing_is_staged_while_a_request_is_queued():
    # Behind a queue a session that comes back waits, and the queue's prefetch brings it in:
    # staged now it would only take DRAM from the queue's head.
    p = ReturnsPolicy()
    d = Driver(p)
    regular_session_then_staged(p, d)
    d.serve(36.0, seq(3, 6))
    p.hint(d.seq, seq(5, 3))  # queued behind the request being served
    assert p.staging(36.0) == []
    d.serve(36.5, seq(5, 3))  # it starts: nothing is queued any more
    assert [list(s) for s in p.staging(36.5)] == [seq(1, 5)]


def test_staging_never_evicts_a_session_due_sooner_than_the_one_staged():
    p = ReturnsPolicy()
    d = Driver(p)
    for turn, t in enumerate((0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0)):
        d.serve(t, seq(2 - turn % 2, 2 + turn // 2))  # 2 and 1 in turn, each every 10 s
    for key in seq(1, 5):
        p.remove(key)  # conversation 1 (due at 45) is on SSD; DRAM holds 2 (due at 40)
    p.victim(lambda key: False)  # DRAM is full: it has had to evict
    assert p.staging(40.5) == []  # staging 1 would evict 2, which is due sooner: 1 waits
    d.serve(40.8, seq(3, 6))  # a new conversation, due after 1: staging 1 evicts it
    assert [list(s) for s in p.staging(40.8)] == [seq(1, 5)]


def test_a_slow_tier_admits_only_what_staging_will_bring_back():
    compute = ComputeModel()
    slow = TierContext(level=1, chunk_load_s=2 * compute.chunk_recompute_s(0, 512), compute=compute)
    p = ReturnsPolicy(slow)
    d = Driver(p)
    for turn, t in enumerate((0.0, 10.0, 20.0, 30.0)):  # a fixed 10 s think time
        d.serve(t, seq(1, 2 + turn))
    for n, t in enumerate((31.0, 31.2, 34.2)):  # another comes back at random
        d.serve(t, seq(2, 2 + n))
    d.begin(34.5)
    assert p.admit(k(1, 0), None)  # regular: it is staged into DRAM before its turn
    assert not p.admit(k(2, 0), None)  # a hit on it from this tier would cost more than a miss
    fast = ReturnsPolicy(TierContext(level=1, chunk_load_s=0.0))
    assert fast.admit(k(2, 0), None)  # from a fast tier every hit saves
    guessed = ReturnsPolicy(TierContext(level=1, chunk_load_s=slow.chunk_load_s, costs_known=False))
    Driver(guessed).serve(31.0, seq(2, 2))
    assert guessed.admit(k(2, 0), None)  # nominal costs (a live store's) never refuse a tier


def store_of(layout: KVLayout, host_chunks: int, disk_path) -> KVStore:
    per = header_len_for(layout.num_layers) + layout.chunk_bytes
    return KVStore(StoreConfig(model="tiny@1", layout=layout, policy="returns",
                               host=HostTierConfig(host_chunks * layout.chunk_bytes),
                               disk=DiskTierConfig(str(disk_path), 64 * per)))


def test_the_live_store_runs_with_returns(layout, tmp_path):
    c = layout.chunk_tokens
    a, b = list(range(3 * c)), list(range(1000, 1000 + 3 * c))
    kva, kvb = make_kv(layout, 3 * c, seed=1), make_kv(layout, 3 * c, seed=2)
    with store_of(layout, host_chunks=3, disk_path=tmp_path) as store:
        store.save(a, kva)
        store.save(b, kvb)
        for tokens, kv in ((a, kva), (b, kvb)):
            hit = store.lookup(tokens)
            loaded = store.load(hit)
            assert loaded.tokens == hit.hit_tokens == 3 * c
            for got, want in zip(loaded.kv, kv):
                assert all(g.equal(w[:, : 3 * c]) for g, w in zip(got, want))
        assert store.snapshot()["tiers"]["host"]["used_bytes"] <= 3 * layout.chunk_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_live_store_stages_a_conversation_in_the_background_before_it_comes_back(
        layout, tmp_path, monkeypatch):
    import kvtier.store.cache as cache_module
    import kvtier.store.cache_reads as cache_reads_module
    import kvtier.store.cache_requests as cache_requests_module
    import kvtier.store.cache_writes as cache_writes_module

    clock = Clock()
    for module in (cache_module, cache_reads_module, cache_requests_module, cache_writes_module):
        monkeypatch.setattr(module, "time", clock)  # the requests' start times, as begin sees them
    c = layout.chunk_tokens
    alice = list(range(2 * c))
    with store_of(layout, host_chunks=4, disk_path=tmp_path) as store:
        for turn in range(4):  # alice: a turn every 10 s, two more chunks each time
            clock.now = 1000.0 + 10 * turn
            tokens = alice + list(range(500, 500 + 2 * c * turn))
            store.started(f"alice-{turn}")
            store.lookup(tokens, request=f"alice-{turn}")
            store.save(tokens, make_kv(layout, len(tokens)), request=f"alice-{turn}")
            store.finished(f"alice-{turn}")
        last = tokens
        clock.now = 1032.0  # bob's long first turn pushes her out of DRAM
        bob = list(range(3000, 3000 + 4 * c))
        store.started("bob")
        store.save(bob, make_kv(layout, len(bob), seed=9), request="bob")
        assert store.lookup(last).tiers[:2] == ["disk", "disk"]
        clock.now = 1036.0  # 4 s before she is due: the next request's start stages her
        store.started("carol")
        assert store.cache.flush(timeout=10)
        assert store.lookup(last).tiers[:4] == ["host"] * 4  # as much as DRAM holds
        assert store.snapshot()["prefetched"] >= 2


@pytest.mark.parametrize("reply_saved_after_finished", [False, True], ids=["in-process", "vLLM order"])
def test_the_live_store_tells_the_policy_when_a_turn_arrived_and_when_its_reply_was_done(
        layout, tmp_path, monkeypatch, reply_saved_after_finished):
    import kvtier.store.cache as cache_module
    import kvtier.store.cache_reads as cache_reads_module
    import kvtier.store.cache_requests as cache_requests_module
    import kvtier.store.cache_writes as cache_writes_module

    clock = Clock()
    for module in (cache_module, cache_reads_module, cache_requests_module, cache_writes_module):
        monkeypatch.setattr(module, "time", clock)
    c = layout.chunk_tokens
    tokens = list(range(c))
    with store_of(layout, host_chunks=8, disk_path=tmp_path) as store:
        for turn, wait in enumerate((0.0, 30.0, 2.0)):  # queued 0, 30 and 2 s; 8 s to reply
            name = f"alice-{turn}"
            store.queued(name, store.keys_for(tokens))
            clock.now += wait
            store.started(name)
            store.lookup(tokens, request=name)
            store.save(tokens, make_kv(layout, len(tokens)), request=name)  # the prompt
            tokens = tokens + list(range(100 * turn + 5000, 100 * turn + 5000 + c))
            clock.now += 8.0
            if reply_saved_after_finished:  # vLLM's scheduler says so before the worker saves
                store.finished(name)
                store.started(f"bob-{turn}")  # and serves another request meanwhile
            store.save(tokens, make_kv(layout, len(tokens)), request=name)  # the reply
            if not reply_saved_after_finished:
                store.finished(name)
            clock.now += 12.0  # she reads and answers
        sessions = list(store.cache.placement.policies[0].inner._sessions.values())
        assert len(sessions) == 1  # the reply's save was her request's: one session, one use each
        # (bob's requests touch nothing of their own)
        alice = sessions[0]
        assert alice.uses == 3 and alice.gaps == 2
        assert alice.gap_sum == pytest.approx(24.0)  # 12 s each, not 50 and 22


@pytest.mark.parametrize("level", [0, 1])
def test_every_hook_is_safe_on_an_empty_policy(level):
    p = ReturnsPolicy(TierContext(level=level))
    p.begin(0, 0.0)
    assert p.staging(0.0) == [] and p.victim(lambda key: True) is None and len(p) == 0
    p.touch([k(1)], start=3)
    p.remove(k(1))
    p.arrived(5, [k(1)], 1.0)  # never hinted, keys never seen
    p.finished(7, 2.0)  # never begun
