"""The session book: what session hints (:mod:`kvtier.core.session_hints`) told the store, kept
for placement.

A hinted request names its session. The session holds the chunks of its latest sequence from
position 0: the request's prompt (its ``queued`` keys), extended by the touches that carry the
request's ``use`` (its saves, its reply's included, even after it finished). A chunk may belong
to several sessions (a shared system prompt). Each session is

- *retained*: its hint asked for ``retain_s`` and its tenant's quota took it
  (:class:`~kvtier.core.session_quota.TenantQuota`) -- until ``retain_s`` after its last
  request's finish (then it *expires*);
- *named*: no retention asked (``retain_s`` 0), or refused by the quota -- ranked as unhinted;
- *dead*: done (the request that carried ``done`` finished) or expired: it is forgotten, and
  its chunks no other remembered session holds are *doomed* (evicted first, from every tier).
  A doomed chunk that another request uses again is no longer doomed.

Eviction order, which :class:`~kvtier.core.policies.hinted.HintedPolicy` applies in each tier:
doomed chunks first, then the chunks of no retained session in the tier's own policy order,
last the retained sessions' chunks, the session expected back farthest first (its last finish
plus ``return_s``; without ``return_s`` its retain expiry; with a request queued or running:
now), its deepest chunk first. A chunk several retained sessions hold ranks with the one
expected back soonest.

Staging: a retained session with ``return_s``, not done, idle, whose chunks are not all in DRAM,
is due for a prefetch into DRAM from ``expected - lead`` on (``lead = max(1 s, return_s / 2)``),
asked again every :data:`RETRY_S` while chunks are left below and it is not due yet
(:meth:`SessionBook.due`). While that prefetch runs, the thread's
:meth:`SessionBook.ceiling` lets it evict only chunks ranked before the session.

Not thread-safe: the store calls it under its lock; :meth:`ceiling` is per thread.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.core.session_doomed import DoomedChunks
from kvtier.core.session_hints import SessionHint
from kvtier.core.session_quota import TenantQuota

MAX_SESSIONS = 65536
"""Sessions remembered at most; the least recently hinted are forgotten (unhinted from then)."""
RECENT_USES = 8
"""A session's latest requests whose touches still extend it (saves of a reply after its end)."""
MAX_DEAD_USES = 4096
"""Requests of dead sessions remembered, so that their late saves are doomed as they land."""
MIN_LEAD_S = 1.0
LEAD_SHARE = 0.5
RETRY_S = 0.5
"""A staging that left chunks below DRAM is asked again this much later, until it is due."""


@dataclass(slots=True)
class HintStats:
    accepted: int = 0
    refused: int = 0
    """Hints asking for retention that their tenant's quota (or the global cap) refused."""
    done: int = 0
    """Sessions ended by a ``done`` hint (its request finished)."""
    stagings: int = 0
    """Retained sessions' prefetches into DRAM started ahead of their expected return."""
    staged_chunks: int = 0
    """Chunks those prefetches promoted into DRAM (counted by the store)."""


@dataclass(frozen=True, slots=True)
class Staging:
    """A session due in DRAM: prefetch ``keys``, evicting only what ranks before ``expected``."""

    keys: list[ChunkKey]
    expected: float
    entry: Shape | None
    tenant: str | None
    """Whose keys they are (the ``tenant`` of the request that named them)."""


@dataclass(slots=True, eq=False)
class _Session:
    name: tuple[str, str]
    """(quota tenant, session id)."""
    weight: int
    keys: list[ChunkKey] = field(default_factory=list)
    retain_s: float = 0.0
    return_s: float | None = None
    retained: bool = False
    done_use: int | None = None
    active: set[int] = field(default_factory=set)
    uses: deque[int] = field(default_factory=deque)
    finished_at: float | None = None
    staged_for: float | None = None
    entry: Shape | None = None
    key_tenant: str | None = None

    def expected(self) -> float:
        """When it is expected back (-inf: now, a request of it is queued or running)."""
        if self.active or self.finished_at is None:
            return -math.inf
        return self.finished_at + (self.return_s if self.return_s is not None else self.retain_s)


class SessionBook:
    """Hinted sessions and their chunks, shared by every tier's :class:`HintedPolicy`.

    ``holds(key, level)`` answers whether a tier holds a chunk (the store's index; bound with
    :meth:`bind` once the index exists); ``clock`` is the ``now`` of the store's hooks."""

    def __init__(self, levels: int, capacity_bytes: int, share: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.levels = levels
        self.quota = TenantQuota(capacity_bytes, share)
        self.clock = clock
        self.stats = HintStats()
        self.retained = 0
        """Sessions retained now."""
        self.holds: Callable[[ChunkKey, int], bool] = lambda key, level: False
        self.tracking = False
        """Whether any session was ever hinted (until then the policies' wrappers do nothing)."""
        self.holders: dict[ChunkKey, set[_Session]] = {}
        self.doomed = DoomedChunks(levels, self.holds)
        self._sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()
        self._by_use: dict[int, _Session] = {}
        self._dead_uses: OrderedDict[int, None] = OrderedDict()
        self._expiries: list[tuple[float, int, _Session, float]] = []
        self._stagings: list[tuple[float, int, _Session, float]] = []
        self._tie = itertools.count()
        self._order: list[_Session] | None = None
        self._local = threading.local()

    def bind(self, holds: Callable[[ChunkKey, int], bool]) -> None:
        self.holds = self.doomed.holds = holds

    # -- hooks --------------------------------------------------------------------------------
    def hinted(self, use: int, keys: Sequence[ChunkKey], hint: SessionHint, tenant: str, *,
               weight: int, entry: Shape | None = None, key_tenant: str | None = None) -> bool:
        """Request ``use`` (queued now, needing ``keys`` from position 0) carries ``hint``;
        ``tenant``: whose quota it counts against; ``weight``: bytes of one of its chunks.
        False if it asked for retention and the quota refused it (then the session is named
        only: not retained, not staged)."""
        self.tracking = True
        self.advance(self.clock())
        name = (tenant, hint.session)
        s = self._sessions.get(name)
        if s is None:
            s = self._sessions[name] = _Session(name, weight)
            while len(self._sessions) > MAX_SESSIONS:
                self._drop(next(iter(self._sessions.values())), doom=False)
        self._sessions.move_to_end(name)
        prev = self._by_use.get(use)
        if prev is not None and prev is not s:  # the same request named another session before
            prev.active.discard(use)
        s.active.add(use)
        self._by_use[use] = s
        if use not in s.uses:
            s.uses.append(use)
        while len(s.uses) > RECENT_USES:
            old = s.uses.popleft()
            if old not in s.active and self._by_use.get(old) is s:
                del self._by_use[old]
        s.retain_s, s.return_s = hint.retain_s, hint.return_s
        s.done_use = use if hint.done else None
        s.entry, s.key_tenant = entry, key_tenant
        keys = list(keys)
        new = s.keys if keys == s.keys[: len(keys)] else keys  # a prefix of what it holds: kept
        wants = hint.retain_s > 0 and not hint.done
        ok = not wants or self.quota.fits(tenant, new, s.weight)  # (what the tenant holds counts once)
        self._set_keys(s, new)
        self._retain(s, wants and ok)
        if ok:
            self.stats.accepted += 1
        else:
            self.stats.refused += 1
        self._order = None
        return ok

    def touched(self, keys: Sequence[ChunkKey], start: int, use: int | None) -> None:
        """A touch (keys ``start, start + 1, ...`` of a sequence) on behalf of request ``use``:
        extends its session's sequence; a dead session's late saves are doomed; any other use of
        a doomed chunk takes it off the doomed list."""
        s = self._by_use.get(use) if use is not None else None
        if s is None:
            if use is not None and use in self._dead_uses:
                for key in reversed(keys):
                    if key not in self.holders:
                        self.doomed.doom(key)
            elif self.doomed:
                for key in keys:
                    self.doomed.spare(key)
            return
        cur, keys = s.keys, list(keys)
        end = start + len(keys)
        if start > len(cur) or (end <= len(cur) and cur[start:end] == keys):
            return  # past a gap, or a part it holds already
        self._set_keys(s, cur[:start] + keys)

    def finished(self, use: int, now: float) -> None:
        """Request ``use``'s reply is done: its session is idle once its last request is; done
        when this request carried ``done``."""
        s = self._by_use.get(use)
        if s is None or use not in s.active:
            return
        s.active.discard(use)
        self._order = None
        if s.done_use == use:
            self.stats.done += 1
            self._drop(s, doom=True)
            return
        if s.active:
            return
        s.finished_at = now
        if s.retained:
            heapq.heappush(self._expiries, (now + s.retain_s, next(self._tie), s, now))
            if s.return_s is not None:
                expected = now + s.return_s
                lead = max(MIN_LEAD_S, LEAD_SHARE * s.return_s)
                heapq.heappush(self._stagings, (expected - lead, next(self._tie), s, expected))

    def advance(self, now: float) -> None:
        """Retained sessions whose ``retain_s`` since their last finish passed expire (dead)."""
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, _, s, finished_at = heapq.heappop(heap)
            if self._sessions.get(s.name) is s and s.retained and not s.active and s.finished_at == finished_at:
                self._drop(s, doom=True)

    def due(self, now: float) -> list[Staging]:
        """The retained sessions to bring into DRAM now: from their lead on, every
        :data:`RETRY_S` until all their chunks are in DRAM or they are due (a staging finds
        room only among the chunks ranked before its session, which another session's expiry
        or end may free later)."""
        self.advance(now)
        out: list[Staging] = []
        retry: list[tuple[float, int, _Session, float]] = []
        heap = self._stagings
        while heap and heap[0][0] <= now:
            _, _, s, expected = heapq.heappop(heap)
            if (self._sessions.get(s.name) is not s or not s.retained or s.return_s is None
                    or s.done_use is not None or s.expected() != expected or s.staged_for == expected):
                continue
            if not s.keys or all(self.holds(k, 0) for k in s.keys) \
                    or not any(self.holds(s.keys[0], lvl) for lvl in range(self.levels)):
                s.staged_for = expected
                continue  # all in DRAM already, or nothing to bring (its first chunk is gone)
            self.stats.stagings += 1
            out.append(Staging(list(s.keys), expected, s.entry, s.key_tenant))
            if now + RETRY_S < expected:  # asked again (a staging finds room only among chunks
                retry.append((now + RETRY_S, next(self._tie), s, expected))  # ranked before it)
            else:
                s.staged_for = expected
        for entry in retry:
            heapq.heappush(heap, entry)
        return out

    # -- what the policies' wrappers ask ------------------------------------------------------
    def protected(self, key: ChunkKey) -> bool:
        """Whether a retained session holds ``key``."""
        holders = self.holders.get(key)
        return holders is not None and any(s.retained for s in holders)

    def retained_order(self) -> Iterator[tuple[float, list[ChunkKey]]]:
        """Each retained session's (expected back, chunks), the session expected back farthest
        first; with a :meth:`ceiling`, only those expected back after it. A chunk ranks with
        the session expected back :meth:`soonest` of those that hold it."""
        if self._order is None:
            self._order = sorted((s for s in self._sessions.values() if s.retained),
                                 key=lambda s: s.expected(), reverse=True)
        ceiling = getattr(self._local, "ceiling", None)
        for s in self._order:
            expected = s.expected()
            if ceiling is not None and expected <= ceiling:
                return
            yield expected, s.keys

    def soonest(self, key: ChunkKey) -> float:
        """When the retained session expected back soonest of those holding ``key`` is (inf:
        none holds it)."""
        return min((s.expected() for s in self.holders.get(key, ()) if s.retained), default=math.inf)

    @contextmanager
    def ceiling(self, expected: float) -> Iterator[None]:
        """Within it, this thread's evictions take only chunks ranked before a retained session
        expected back at ``expected`` (a staging's prefetch)."""
        self._local.ceiling = expected
        try:
            yield
        finally:
            self._local.ceiling = None

    # -- bookkeeping --------------------------------------------------------------------------
    def _set_keys(self, s: _Session, new: list[ChunkKey]) -> None:
        old = s.keys
        n = 0
        for a, b in zip(old, new, strict=False):
            if a != b:
                break
            n += 1
        gone, added = old[n:], new[n:]
        for key in gone:
            holders = self.holders.get(key)
            if holders is not None:
                holders.discard(s)
                if not holders:
                    del self.holders[key]
        for key in added:
            self.holders.setdefault(key, set()).add(s)
            self.doomed.spare(key)
        if s.retained:
            self.quota.remove(s.name[0], gone, s.weight)
            self.quota.add(s.name[0], added, s.weight)
        s.keys = new

    def _retain(self, s: _Session, retained: bool) -> None:
        if retained == s.retained:
            return
        s.retained = retained
        self.retained += 1 if retained else -1
        (self.quota.add if retained else self.quota.remove)(s.name[0], s.keys, s.weight)

    def _drop(self, s: _Session, *, doom: bool) -> None:
        """Forget session ``s``; ``doom``: it is dead, and its chunks no other session holds go
        first (deepest first)."""
        self._retain(s, False)
        del self._sessions[s.name]
        for use in s.uses:
            if self._by_use.get(use) is s:
                del self._by_use[use]
                if doom:
                    self._dead_uses[use] = None
        while len(self._dead_uses) > MAX_DEAD_USES:
            self._dead_uses.popitem(last=False)
        for key in reversed(s.keys):
            holders = self.holders.get(key)
            if holders is None:
                continue
            holders.discard(s)
            if not holders:
                del self.holders[key]
                if doom:
                    self.doomed.doom(key)
        self._order = None
