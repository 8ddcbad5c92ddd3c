"""Session hints as placement sees them, told as stories over a placement that counts chunks:
a done session goes first (but not what a live session shares), retained sessions go last and
farthest first, the quota refuses what would go over, a retained session is staged once before
it is due and only at the expense of chunks ranked before it."""

from __future__ import annotations

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
