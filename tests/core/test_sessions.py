"""Session hints as placement sees them, told as stories over a placement that counts chunks:
a done session goes first (but not what a live session or unhinted traffic shares, nor what
another request of it added), retained sessions go last and farthest first (an overdue one as
if it expired), the quota refuses what would go over (at the hint and as the session grows), a
retained session is staged once before it is due and only at the expense of chunks ranked
before it, a request that never finishes times out, and what the book keeps stays bounded."""

from __future__ import annotations

import time

import pytest

from kvtier.bench.simstore import ChunkCounter
from kvtier.core import sessions as sessions_module
from kvtier.core.keys import ChunkKey
from kvtier.core.placement import Placement
from kvtier.core.policies.base import TierContext
from kvtier.core.policies.hinted import HintedPolicy, hinted_policies
from kvtier.core.policy import make_policy
from kvtier.core.session_hints import SessionHint
from kvtier.core.sessions import SessionBook


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def k(name: str) -> ChunkKey:
    return ChunkKey(name.encode().ljust(16, b"."))


class Place:
    """A placement over chunk counters (1 byte a chunk for the quota), its policies hinted."""

    def __init__(self, *capacity: int, share: float = 0.5, policy: str = "lru") -> None:
        self.clock = Clock()
        self.mover = ChunkCounter(tuple(capacity))
        self.book = SessionBook(len(capacity), sum(capacity), share, clock=self.clock)
        policies = [make_policy(policy, TierContext(level=lvl)) for lvl in range(len(capacity))]
        self.placement = Placement(hinted_policies(policies, self.book), self.mover)
        self.book.bind(self.placement.index.holds)

    def hint(self, use: int, keys: list[ChunkKey], session: str, tenant: str = "", **kw) -> bool:
        return self.book.hinted(use, keys, SessionHint(session, **kw), tenant, weight=1)

    def save(self, keys: list[ChunkKey], use: int | None = None, start: int = 0) -> None:
        place = self.placement
        for i, key in enumerate(keys):
            if key not in place.index:
                assert place.room_for_new(key, start + i)
                self.mover.write(key, 0)
                place.added(key, 0, position=start + i)
        place.touch(keys, start=start, use=use)

    def finish(self, use: int) -> None:
        self.book.finished(use, self.clock())

    def in_dram(self, *keys: ChunkKey) -> list[bool]:
        return [self.placement.index.holds(key, 0) for key in keys]

    def check(self) -> None:
        """The book's count of retained chunks in each tier is what the tiers hold."""
        index = self.placement.index
        for level in range(self.book.levels):
            held = sum(1 for key in index if index.holds(key, level) and self.book.protected(key))
            assert self.book.retained_at[level] == held

    def evictions(self, n: int, level: int = 0) -> list[ChunkKey]:
        """The next ``n`` chunks evicted from ``level``, in order."""
        out = []
        for _ in range(n):
            before = {key for key in self.placement.index if self.placement.index.holds(key, level)}
            assert self.placement.evict(level)
            after = {key for key in self.placement.index if self.placement.index.holds(key, level)}
            out.extend(before - after)
        return out


def test_a_done_sessions_chunks_go_first_but_a_chunk_it_shares_with_a_live_session_stays():
    p = Place(4)
    system, mine, theirs, other = k("system"), k("live-1"), k("done-1"), k("unhinted")
    p.hint(1, [system, mine], "live", retain_s=60)  # running: expected back now
    p.save([system, mine], use=1)
    p.hint(2, [system, theirs], "gone", done=True)
    p.save([system, theirs], use=2)
    p.save([other])  # no session
    p.finish(2)  # the request that said done finished
    assert p.book.stats.done == 1 and p.book.doomed.keys() == {theirs}
    p.save([k("new-1")])  # DRAM is full: the done session's own chunk goes first
    assert p.in_dram(theirs, system, mine, other) == [False, True, True, True]
    p.save([k("new-2")])  # then the unhinted chunks, in LRU order, before the live session's
    assert p.in_dram(other, system, mine) == [False, True, True]
    p.save([k("new-3")])
    assert p.in_dram(k("new-1"), system, mine) == [False, True, True]


def test_retained_sessions_go_last_the_one_expected_back_farthest_first_its_deepest_chunk_first():
    p = Place(9, share=1.0)
    soon, later, expiring = ([k(f"{s}-{i}") for i in range(2)] for s in ("soon", "later", "expiring"))
    p.hint(1, soon, "soon", retain_s=60, return_s=5)
    p.hint(2, later, "later", retain_s=60, return_s=20)
    p.hint(3, expiring, "expiring", retain_s=30)  # no return_s: expected back when it expires
    p.hint(4, [k("busy")], "busy", retain_s=60)  # a request running: expected now
    p.hint(5, [k("named")], "named")  # retain_s 0: named only, ranked as unhinted
    for use, keys in ((1, soon), (2, later), (3, expiring), (4, [k("busy")]), (5, [k("named")])):
        p.save(keys, use=use)
    p.save([k("plain")])
    for use in (1, 2, 3, 5):
        p.finish(use)
    assert p.book.retained == 4
    assert p.evictions(9) == [k("named"), k("plain"), expiring[1], expiring[0], later[1], later[0],
                              soon[1], soon[0], k("busy")]


def test_a_session_past_its_retain_s_expires_and_its_chunks_go_first():
    p = Place(3, share=1.0)
    keys = [k("a-0"), k("a-1")]
    p.hint(1, keys, "a", retain_s=10)
    p.save(keys, use=1)
    p.save([k("plain")])
    p.finish(1)
    assert p.evictions(1) == [k("plain")]  # retained: the unhinted chunk goes first
    p.save([k("plain")])
    p.clock.now += 10.5  # expired
    assert p.evictions(2) == [k("a-1"), k("a-0")] and p.book.retained == 0


def test_the_quota_refuses_retention_past_a_tenants_share_and_past_the_global_cap():
    p = Place(4, 6, share=0.3)  # 10 chunks of local capacity: 3 a tenant
    four = [k(f"big-{i}") for i in range(4)]
    assert not p.hint(1, four, "big", tenant="acme", retain_s=60)
    assert p.book.stats.refused == 1 and p.book.retained == 0
    assert all(key in p.book.holders for key in four)  # named all the same: not retained
    three = [k(f"s-{i}") for i in range(3)]
    assert p.hint(2, three, "fits", tenant="acme", retain_s=60)
    assert p.hint(3, three[:2], "shares", tenant="acme", retain_s=60)  # what it shares counts once
    assert not p.hint(4, [*three[:2], k("more")], "over", tenant="acme", retain_s=60)
    assert p.hint(5, [k("other-0")], "fits", tenant="other", retain_s=60)  # another tenant's quota
    assert p.book.stats.accepted == 3 and p.book.stats.refused == 2 and p.book.retained == 3
    assert p.hint(6, [k("done")], "done", tenant="acme", done=True)  # no retention asked: accepted

    p = Place(4, 6, share=0.5)  # 5 a tenant, 9 in all
    assert p.hint(1, [k(f"a-{i}") for i in range(5)], "a", tenant="a", retain_s=60)
    assert not p.hint(2, [k(f"b-{i}") for i in range(5)], "b", tenant="b", retain_s=60)
    assert p.hint(3, [k(f"b-{i}") for i in range(4)], "b2", tenant="b", retain_s=60)

    p = Place(4, share=0)  # retention disabled
    assert not p.hint(1, [k("x")], "x", retain_s=60) and p.book.retained == 0


def test_a_session_is_staged_once_before_it_is_due_evicting_only_what_ranks_before_it():
    p = Place(2, 8, share=0.9)
    agent = [k("agent-0"), k("agent-1")]
    p.hint(1, agent, "agent", retain_s=60, return_s=4)  # its tool takes 4 s
    p.save(agent, use=1)
    p.finish(1)  # at 100: expected back at 104, staged from 102 (lead: max(1 s, 4 s / 2))
    slow = [k("slow-0"), k("slow-1")]
    p.hint(2, slow, "slow", retain_s=600, return_s=300)
    p.save(slow, use=2)  # running: the agent's chunks, expected back later, go down to SSD
    assert p.in_dram(*agent) == [False, False] and p.in_dram(*slow) == [True, True]
    p.finish(2)  # expected back at 400
    p.clock.now = 101.9
    assert p.book.due(p.clock()) == []
    p.clock.now = 102.0
    (due,) = p.book.due(p.clock())
    assert due.keys == agent and due.expected == 104.0 and p.book.stats.stagings == 1
    assert p.book.due(p.clock()) == []  # once per expected return
    with p.book.ceiling(due.expected):
        assert p.placement.prefetch(due.keys) == 2  # the slow session ranks before it: it goes
    assert p.in_dram(*agent) == [True, True]

    busy = [k("busy-0"), k("busy-1")]  # a session being served ranks after every idle one
    p.hint(3, busy, "busy", retain_s=60)
    p.save(busy, use=3)
    assert p.in_dram(*busy) == [True, True] and p.in_dram(*agent) == [False, False]
    with p.book.ceiling(due.expected):
        assert p.placement.prefetch(agent) == 0  # nothing it may evict: it stays on SSD
    assert p.in_dram(*busy) == [True, True]


def test_a_request_saves_extend_its_session_even_after_it_finished_and_a_done_ones_are_doomed():
    p = Place(8)
    prompt, reply = [k("p-0"), k("p-1")], k("reply")
    p.hint(1, prompt, "a", retain_s=60)
    p.save(prompt, use=1)
    p.finish(1)
    p.save([*prompt, reply], use=1)  # its reply, saved after it finished
    assert p.book.holders[reply] and p.book.protected(reply)
    p.hint(2, [*prompt, reply], "a", done=True)
    p.finish(2)
    assert p.book.doomed.keys() == {*prompt, reply} and p.book.retained == 0
    late = k("late")
    p.save([*prompt, reply, late], use=2)  # the done request's own tail, saved after its end
    assert late in p.book.doomed
    p.save(prompt)  # another request uses the prompt again: no longer doomed
    assert p.book.doomed.keys() == {reply, late}


def test_the_least_recently_hinted_session_is_forgotten_past_the_limit(monkeypatch):
    monkeypatch.setattr(sessions_module, "MAX_SESSIONS", 2)
    p = Place(8)
    for use, name in enumerate("abc"):
        p.hint(use, [k(name)], name, retain_s=60)
        p.save([k(name)], use=use)
    assert k("a") not in p.book.holders and not p.book.doomed.keys()  # forgotten: unhinted, not doomed
    assert p.book.retained == 2


@pytest.mark.parametrize("policy", ["lru", "returns"])
def test_without_hints_the_wrapper_only_forwards(policy):
    hinted, bare = Place(3, policy=policy), Place(3, policy=policy)
    bare.placement.policies = [p.inner for p in bare.placement.policies]  # type: ignore[attr-defined]
    assert all(isinstance(p, HintedPolicy) for p in hinted.placement.policies)
    for place in (hinted, bare):
        for i in range(6):
            place.placement.begin(i, float(i))
            place.save([k(f"s{i % 4}-0"), k(f"s{i % 4}-{i}")], use=i)
    assert not hinted.book.tracking
    assert hinted.evictions(3) == bare.evictions(3)


def test_a_victim_costs_nothing_that_grows_with_how_many_sessions_share_a_prefix():
    """300 retained sessions share a 20-chunk system prompt. Each victim used to walk every
    session's chunks and, for each shared one, every session holding it (seconds at 1000)."""
    n, prefix = 300, [k(f"p{i}") for i in range(20)]
    p = Place(20 + 4 * n, 10**6, share=1.0)
    for s in range(n):
        own = [k(f"s{s}o{j}") for j in range(4)]
        assert p.hint(s, prefix + own, f"s{s}", retain_s=3600, return_s=1000 + s)
        p.save(prefix + own, use=s)
        p.finish(s)
    calls, holds = 0, p.book.holds

    def counted(key: ChunkKey, level: int) -> bool:
        nonlocal calls
        calls += 1
        return holds(key, level)

    p.book.holds = counted
    policy, shared = p.placement.policies[0], set(prefix)
    began = time.perf_counter()
    # only the prompt may go: every session's own chunks are passed once, the prompt once
    assert policy.victim(lambda key: key in shared) == prefix[-1]
    assert calls <= 4 * n + 20
    calls = 0
    assert p.evictions(5) == [k("s299o3"), k("s299o2"), k("s299o1"), k("s299o0"), k("s298o3")]
    for _ in range(200):  # successive victims skip what earlier ones took, once
        assert p.placement.evict(0)
    assert calls <= 3 * 205
    assert time.perf_counter() - began < 2.0  # (was minutes)
    p.check()


def test_a_done_hint_dooms_only_the_chunks_its_own_request_used():
    p = Place(8)
    public, private, late = k("public"), [k("private-1"), k("private-2")], k("late")
    p.hint(1, [public, *private], "agent-17", retain_s=600, return_s=30)
    p.save([public, *private], use=1)
    p.finish(1)
    # someone who knows the session's id and its public prompt ends it
    p.hint(2, [public], "agent-17", done=True)
    p.finish(2)
    assert p.book.stats.done == 1 and p.book.retained == 0
    assert p.book.doomed.keys() == {public}  # not the chunks another request of it added
    p.save([*private, late], use=1, start=1)  # the first request's late save: not doomed either
    assert p.book.doomed.keys() == {public}
    p.check()

    p = Place(8)  # the done request's own saves are its own
    p.hint(1, [public, *private], "a", retain_s=600)
    p.save([public, *private], use=1)
    p.finish(1)
    p.hint(2, [public], "a", done=True)
    p.save([public, k("reply")], use=2)
    p.finish(2)
    assert p.book.doomed.keys() == {public, k("reply")}


def test_a_retained_session_whose_saves_pass_its_quota_is_retained_no_more():
    p = Place(10)  # a tenant retains 5 chunks at most, all tenants 9
    prompt = [k("prompt")]
    assert p.hint(1, prompt, "grows", retain_s=600)
    p.save([*prompt, *(k(f"r{i}") for i in range(4))], use=1)  # 5: within its share
    assert p.book.retained == 1 and p.book.quota.held_bytes("") == 5
    p.save([k(f"r{i}") for i in range(4, 9)], use=1, start=5)  # 10: past it
    assert p.book.retained == 0 and p.book.stats.refused == 1 and p.book.quota.held_bytes("") == 0
    assert not p.book.protected(prompt[0]) and prompt[0] in p.book.holders  # named only
    p.check()

    p = Place(4, 6)  # two tenants within their shares, together past the global cap
    assert p.hint(1, [k(f"a{i}") for i in range(5)], "a", tenant="a", retain_s=600)
    assert p.hint(2, [k(f"b{i}") for i in range(4)], "b", tenant="b", retain_s=600)
    p.placement.touch([k("b4")], start=4, use=2)
    assert p.book.retained == 1 and p.book.stats.refused == 1 and p.book.quota.total_bytes == 5


def test_a_hinted_request_that_never_finishes_times_out_and_its_session_expires():
    p = Place(8)
    q = k("q")
    p.hint(1, [q], "s", retain_s=1, return_s=0.5)
    p.save([q], use=1)
    p.finish(1)
    p.hint(2, [q], "s", retain_s=1, return_s=0.5)  # its next request: its finish never comes
    p.clock.now += sessions_module.MAX_ACTIVE_S - 1
    p.book.advance(p.clock())
    assert p.book.retained == 1  # still running, as far as anyone knows
    p.clock.now += 2.5  # it counts as finished at its time-out, and retain_s later it expires
    p.book.advance(p.clock())
    assert p.book.retained == 0 and p.book.quota.held_bytes("") == 0 and p.book.doomed.keys() == {q}
    p.check()


def test_a_chunk_unhinted_traffic_shares_is_not_doomed_with_a_done_session():
    system, user, agent, cold = k("system"), k("user"), k("agent"), k("cold")
    p = Place(4)
    p.save([cold])
    p.save([system, user])  # unhinted traffic stored the system prompt
    p.hint(5, [system, agent], "agent", done=True)
    p.save([system, agent], use=5)
    p.finish(5)
    assert p.book.doomed.keys() == {agent}
    assert p.evictions(2) == [agent, cold]

    p = Place(4)
    p.hint(5, [system, agent], "agent", done=True)
    p.save([system, agent], use=5)
    p.save([system, user])  # unhinted traffic uses it while the session holds it
    p.finish(5)
    assert p.book.doomed.keys() == {agent}

    p = Place(4)  # a hinted request's own lookup, come before its hint, shares nothing
    p.hint(1, [system, agent], "agent", retain_s=60)
    p.save([system, agent], use=1)
    p.finish(1)
    p.placement.touch([system, agent], use=2)
    p.hint(2, [system, agent], "agent", done=True)
    p.finish(2)
    assert p.book.doomed.keys() == {system, agent}

    p = Place(2, 8, share=0.9)  # nor does the store's own staging of a session
    p.hint(1, [system, agent], "agent", retain_s=60, return_s=4)
    p.save([system, agent], use=1)
    p.finish(1)
    p.hint(2, [k("busy")], "busy", retain_s=60)
    p.save([k("busy")], use=2)
    p.clock.now += 2
    (due,) = p.book.due(p.clock())
    with p.book.ceiling(due.expected):
        p.placement.prefetch(due.keys)
    p.hint(3, [system, agent], "agent", done=True)
    p.finish(3)
    assert p.book.doomed.keys() == {system, agent}


def test_an_overdue_session_ranks_as_if_it_expired_and_is_not_staged():
    p = Place(3, share=1.0)
    old, soon = k("old"), k("soon")
    p.hint(1, [old], "old", retain_s=3600, return_s=5)
    p.save([old], use=1)
    p.finish(1)  # expected back at 105; it never comes
    p.clock.now += 600
    p.hint(2, [soon], "soon", retain_s=3600, return_s=5)
    p.save([soon], use=2)
    p.finish(2)  # expected back at 705
    assert p.evictions(1) == [old]  # ranked by its retain expiry (3700), not as due long ago
    p.check()

    p = Place(1, 8, share=0.9)
    a = k("a")
    p.hint(1, [a], "a", retain_s=3600, return_s=4)
    p.save([a], use=1)
    p.finish(1)  # expected at 104, staged from 102
    p.hint(2, [k("busy")], "busy", retain_s=60)
    p.save([k("busy")], use=2)  # a request running: a goes down to SSD
    assert p.in_dram(a) == [False]
    p.clock.now = 104 + 10  # the store was too busy to ask until it was overdue (109)
    assert p.book.due(p.clock()) == []


def test_a_staging_starts_at_most_max_lead_s_early_and_backs_off_while_it_finds_no_room():
    p = Place(1, 8, share=0.9)
    a = k("a")
    p.hint(1, [a], "a", retain_s=3600, return_s=600)
    p.save([a], use=1)
    p.finish(1)  # expected at 700: staged from 690, not 400
    p.hint(2, [k("busy")], "busy", retain_s=60)
    p.save([k("busy")], use=2)  # a running session holds DRAM: the staging finds no room
    asked = []
    for step in range(4 * 390, 4 * 702):
        p.clock.now = step / 4
        if p.book.due(p.clock()):
            asked.append(p.clock.now)
    assert asked == [690.0, 690.5, 691.5, 693.5, 697.5]  # 0.5 s, then twice as long each time


def test_the_books_deadlines_and_chunks_stay_bounded(monkeypatch):
    p = Place(4, share=1.0)
    for use in range(1000):  # a session that finishes over and over, retained for a day
        p.hint(use, [k("a")], "a", retain_s=86400, return_s=600)
        p.finish(use)
    book = p.book
    assert len(book._expiries) < 200 and len(book._stagings) < 200 and len(book._timeouts) < 200

    monkeypatch.setattr(sessions_module, "MAX_TRACKED_KEYS", 5)
    p = Place(8, share=1.0)
    for use, name in enumerate("abc"):
        p.hint(use, [k(f"{name}-0"), k(f"{name}-1")], name, retain_s=60)
    assert k("a-0") not in p.book.holders and k("b-0") in p.book.holders  # the oldest forgotten
    p.placement.touch([k("c-2"), k("c-3")], start=2, use=2)  # growing past it forgets b too
    assert k("b-0") not in p.book.holders and p.book.retained == 1


def test_a_forgotten_session_is_not_brought_back_by_a_late_save_of_an_old_request(monkeypatch):
    monkeypatch.setattr(sessions_module, "MAX_SESSIONS", 1)
    p = Place(8)
    for use in range(sessions_module.RECENT_USES + 1):  # its first request leaves its recent ones
        p.hint(use, [k("a")], "a", retain_s=60)
    p.hint(100, [k("b")], "b", retain_s=60)  # "a" is forgotten
    p.save([k("a"), k("a-late")], use=0)
    assert k("a") not in p.book.holders and k("a-late") not in p.book.holders
