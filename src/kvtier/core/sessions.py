"""The session book: what session hints (:mod:`kvtier.core.session_hints`) told the store, kept
for placement.

A hinted request names its session, one per (tenant, session id). The session holds the chunks
of its latest sequence from position 0: the request's prompt (its ``queued`` keys), extended by
the touches that carry the request's ``use`` (its saves, its reply's included, even after it
finished). A chunk may belong to several sessions (a shared system prompt). Each session is

- *retained*: its hint asked for ``retain_s`` and its tenant's quota took it
  (:class:`~kvtier.core.session_quota.TenantQuota`, checked again as its saves grow it) -- until
  ``retain_s`` after its last request's finish (then it *expires*);
- *named*: no retention asked (``retain_s`` 0), or refused by the quota -- ranked as unhinted;
- *dead*: done (the request that carried ``done`` finished) or expired: it is forgotten, and
  its chunks no other remembered session holds are *doomed* (evicted first, from every tier)
  unless shared (:mod:`kvtier.core.session_doomed`) -- a done session's only those its done
  request used, its prompt and its saves: whoever knows a session's name and public prefix must
  not doom the private chunks another request of it added.

A request is *active* from its hint until it finishes, or :data:`MAX_ACTIVE_S` after its hint
(aborted while queued, its ``finished`` lost): it counts as finished then.

Eviction order, which :class:`~kvtier.core.policies.hinted.HintedPolicy` applies in each tier:
doomed chunks first, then the chunks of no retained session in the tier's own policy order,
last the retained sessions' chunks (:mod:`kvtier.core.session_order`), the session expected back
farthest first (its last finish plus ``return_s``; without ``return_s``, or once *overdue* --
not back ``max(5 s, return_s)`` after that -- its retain expiry; with a request active:
now), its deepest chunk first. A chunk several retained sessions hold ranks with the one expected
back soonest.

Staging: a retained session with ``return_s``, not done, idle, not overdue, whose chunks are not
all in DRAM, is due for a prefetch into DRAM from ``expected - lead`` on (``lead = min(MAX_LEAD_S,
max(MIN_LEAD_S, return_s / 2))``), asked again :data:`RETRY_S` later, then twice as long after
each retry, while chunks are left below and it is not due yet (:meth:`SessionBook.due`). While
that prefetch runs, the thread's :meth:`SessionBook.ceiling` lets it evict only chunks ranked
before the session.

Bounds: :data:`MAX_SESSIONS` sessions, :data:`MAX_TRACKED_KEYS` chunks held by them in all (the
least recently hinted forgotten past either).

Not thread-safe: the store calls it under its lock; :meth:`ceiling` is per thread.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.core.session_deadlines import Deadlines
from kvtier.core.session_doomed import DoomedChunks
from kvtier.core.session_hints import SessionHint
from kvtier.core.session_order import RetainedOrder
from kvtier.core.session_quota import TenantQuota
from kvtier.core.session_state import HintStats, Session, Staging

MAX_SESSIONS = 65536
"""Sessions remembered at most; the least recently hinted are forgotten (unhinted from then)."""
MAX_TRACKED_KEYS = 4_000_000
"""Chunks remembered sessions hold in all (once per session holding one) at most."""
RECENT_USES = 8
"""A session's latest requests whose touches still extend it (saves of a reply after its end)."""
MAX_DEAD_USES = 4096
"""Requests of dead sessions remembered, so that their late saves are doomed as they land."""
MAX_ACTIVE_S = 600.0
"""A hinted request not finished this long after its hint counts as finished then."""
MIN_LEAD_S = 1.0
LEAD_SHARE = 0.5
MAX_LEAD_S = 10.0
"""A staging starts at most this long before its session is expected (not minutes early)."""
RETRY_S = 0.5
"""A staging that left chunks below DRAM is asked again this much later, then twice as long
after each retry (one that finds no room does not flood the prefetch queue)."""


class SessionBook:
    """Hinted sessions and their chunks, shared by every tier's :class:`HintedPolicy`.

    ``holds(key, level)`` answers whether a tier holds a chunk (the store's index; bound with
    :meth:`bind` once the index exists); ``clock`` is the ``now`` of the store's hooks."""

    def __init__(self, levels: int, capacity_bytes: int, share: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.levels = levels
        self.quota = TenantQuota(capacity_bytes, share, self._retained_changed)
        self.clock = clock
        self.stats = HintStats()
        self.retained = 0
        """Sessions retained now."""
        self.holds: Callable[[ChunkKey, int], bool] = lambda key, level: False
        self.tracking = False
        """Whether any session was ever hinted (until then the policies' wrappers do nothing)."""
        self.holders: dict[ChunkKey, set[Session]] = {}
        self.retained_at = [0] * levels
        """Per tier: the chunks it holds that a retained session holds (all of them: no
        unhinted victim to look for)."""
        self.doomed = DoomedChunks(levels, self.holds)
        self._tracked = 0
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._by_use: dict[int, Session] = {}
        self._dead_uses: OrderedDict[int, None] = OrderedDict()
        self._expiries: Deadlines[tuple[tuple[str, str], int]] = Deadlines(self._same_finish)
        self._stagings: Deadlines[tuple[tuple[str, str], int]] = Deadlines(self._same_finish)
        self._timeouts: Deadlines[int] = Deadlines(self._still_active)
        self._finishes = itertools.count()
        self._order: RetainedOrder | None = None
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
        now = self.clock()
        self.advance(now)
        name = (tenant, hint.session)
        s = self._sessions.get(name)
        if s is None:
            s = self._sessions[name] = Session(name, weight)
            while len(self._sessions) > MAX_SESSIONS:
                self._drop(next(iter(self._sessions.values())), doom=False)
        self._sessions.move_to_end(name)
        prev = self._by_use.get(use)
        if prev is not None and prev is not s:  # the same request named another session before
            prev.active.pop(use, None)
        s.active[use] = deadline = now + MAX_ACTIVE_S
        self._by_use[use] = s
        self._timeouts.push(deadline, use, len(self._by_use))
        if use not in s.uses:
            s.uses.append(use)
        while len(s.uses) > RECENT_USES:
            old = s.uses.popleft()
            if old not in s.active and self._by_use.get(old) is s:
                del self._by_use[old]
        s.retain_s, s.return_s = hint.retain_s, hint.return_s
        keys = list(keys)
        self.doomed.unshare(keys, use)  # its own lookups (they may come before its hint)
        s.done_use, s.done_keys = (use, keys) if hint.done else (None, [])
        s.entry, s.key_tenant = entry, key_tenant
        new = s.keys if keys == s.keys[: len(keys)] else keys  # a prefix of what it holds: kept
        wants = hint.retain_s > 0 and not hint.done
        ok = not wants or self.quota.fits(tenant, new, s.weight)  # (what the tenant holds counts once)
        self._set_keys(s, new, claim=True)
        self._retain(s, wants and ok)
        if ok:
            self.stats.accepted += 1
        else:
            self.stats.refused += 1
        self._order = None
        self._trim()
        return ok

    def touched(self, keys: Sequence[ChunkKey], start: int, use: int | None) -> None:
        """A touch (keys ``start, start + 1, ...`` of a sequence) on behalf of request ``use``:
        extends its session's sequence (a retained one past its quota is retained no more); a
        dead session's late saves are doomed; a request of no session shares the chunks
        sessions hold, and takes any it uses off the doomed list."""
        s = self._by_use.get(use) if use is not None else None
        if s is None:
            if use is not None and use in self._dead_uses:
                for key in reversed(keys):
                    if key not in self.holders:
                        self.doomed.doom(key)
                return
            holders, doomed = self.holders, self.doomed
            staging = getattr(self._local, "ceiling", None) is not None  # the store's, no request's
            for key in keys:
                if key in holders:
                    if not staging:
                        doomed.share(key, use)
                elif doomed:
                    doomed.spare(key)
            return
        keys = list(keys)
        end = start + len(keys)
        if use == s.done_use:
            own = s.done_keys
            if start <= len(own) and own[start:end] != keys:
                s.done_keys = own[:start] + keys
        cur = s.keys
        if start > len(cur) or (end <= len(cur) and cur[start:end] == keys):
            return  # past a gap, or a part it holds already
        if s.retained and not self.quota.fits(s.name[0], keys, s.weight):
            self._retain(s, False)  # grown past its tenant's share (or the global cap)
            self.stats.refused += 1
        self._set_keys(s, cur[:start] + keys)
        self._trim()

    def finished(self, use: int, now: float) -> None:
        """Request ``use``'s reply is done: its session is idle once its last request is; done
        when this request carried ``done``."""
        s = self._by_use.get(use)
        if s is None or use not in s.active:
            return
        del s.active[use]
        self._order = None
        if s.done_use == use:
            self.stats.done += 1
            self._drop(s, doom=True, done=True)
            return
        if s.active:
            return
        s.finished_at = now
        s.finish = next(self._finishes)
        s.retry_s = RETRY_S
        if s.retained:
            item, live = (s.name, s.finish), len(self._sessions)
            self._expiries.push(now + s.retain_s, item, live)
            if s.return_s is not None:
                lead = min(MAX_LEAD_S, max(MIN_LEAD_S, LEAD_SHARE * s.return_s))
                self._stagings.push(now + s.return_s - lead, item, live)

    def advance(self, now: float) -> None:
        """Requests active for :data:`MAX_ACTIVE_S` count as finished; retained sessions whose
        ``retain_s`` since their last finish passed expire (dead)."""
        for when, use in self._timeouts.due(now):
            self.finished(use, when)
        for _, (name, _finish) in self._expiries.due(now):
            s = self._sessions[name]
            if s.retained and not s.active:
                self._drop(s, doom=True)

    def due(self, now: float) -> list[Staging]:
        """The retained sessions to bring into DRAM now: from their lead on, again after
        :data:`RETRY_S`, twice as long after each retry, until all their chunks are in DRAM or
        they are due (a staging finds room only among the chunks ranked before its session,
        which another session's expiry or end may free later)."""
        self.advance(now)
        out: list[Staging] = []
        retry: list[tuple[float, tuple[tuple[str, str], int]]] = []
        for _, item in self._stagings.due(now):
            s = self._sessions[item[0]]
            expected = s.expected()
            if (not s.retained or s.return_s is None or s.done_use is not None
                    or expected == -math.inf or s.staged_for == expected or now >= s.overdue_at()):
                continue
            if not s.keys or all(self.holds(k, 0) for k in s.keys) \
                    or not any(self.holds(s.keys[0], lvl) for lvl in range(self.levels)):
                s.staged_for = expected
                continue  # all in DRAM already, or nothing to bring (its first chunk is gone)
            self.stats.stagings += 1
            out.append(Staging(list(s.keys), expected, s.entry, s.key_tenant))
            if now + s.retry_s < expected:  # asked again (a staging finds room only among
                retry.append((now + s.retry_s, item))  # chunks ranked before it)
                s.retry_s *= 2
            else:
                s.staged_for = expected
        for when, item in retry:
            self._stagings.push(when, item, len(self._sessions))
        return out

    # -- what the policies' wrappers ask ------------------------------------------------------
    def protected(self, key: ChunkKey) -> bool:
        """Whether a retained session holds ``key``."""
        return self.quota.retains(key)

    def retained_victim(self, level: int, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        """The retained sessions' chunk tier ``level`` evicts next (see the module; with a
        :meth:`ceiling`, only among those ranked after it); None: none it holds may go."""
        now = self.clock()
        order = self._order
        if order is None or now >= order.valid_until:
            order = self._order = RetainedOrder.of(self.levels, self._sessions.values(), now)
        return order.victim(level, evictable, self.holds, getattr(self._local, "ceiling", None))

    def inserted(self, key: ChunkKey, level: int) -> None:
        """Tier ``level`` got ``key`` (a save, a promotion, a demotion)."""
        if self.quota.retains(key):
            self.retained_at[level] += 1
        if self._order is not None:
            self._order.inserted(key, level)
        if self.doomed:
            self.doomed.inserted(key, level)

    def removed(self, key: ChunkKey, level: int) -> None:
        """Tier ``level`` dropped ``key``."""
        if self.quota.retains(key):
            self.retained_at[level] -= 1
        if self.doomed:
            self.doomed.removed(key, level)

    @contextmanager
    def ceiling(self, expected: float) -> Iterator[None]:
        """Within it, this thread's evictions take only chunks ranked before a retained session
        expected back at ``expected`` (a staging's prefetch; ``inf``: no retained chunk), and
        its touches are no request's (they share nothing)."""
        self._local.ceiling = expected
        try:
            yield
        finally:
            self._local.ceiling = None

    # -- bookkeeping --------------------------------------------------------------------------
    def _retained_changed(self, key: ChunkKey, delta: int) -> None:
        """``key`` became retained (+1) or no longer is (-1): :attr:`retained_at` follows."""
        for level in range(self.levels):
            if self.holds(key, level):
                self.retained_at[level] += delta

    def _same_finish(self, when: float, item: tuple[tuple[str, str], int]) -> bool:
        s = self._sessions.get(item[0])
        return s is not None and s.finish == item[1]

    def _still_active(self, when: float, use: int) -> bool:
        s = self._by_use.get(use)
        return s is not None and s.active.get(use) == when

    def _set_keys(self, s: Session, new: list[ChunkKey], *, claim: bool = False) -> None:
        """``s`` holds ``new`` from now; ``claim``: named by a hint (a chunk stored already that
        no session holds, and not doomed, was stored by a request of no session: shared)."""
        old = s.keys
        n = 0
        for a, b in zip(old, new, strict=False):
            if a != b:
                break
            n += 1
        gone, added = old[n:], new[n:]
        holders = self.holders
        for key in gone:
            hs = holders.get(key)
            if hs is not None:
                hs.discard(s)
                if not hs:
                    del holders[key]
                    self.doomed.released(key)
        for key in added:
            hs = holders.get(key)
            if hs is None:
                if claim and key not in self.doomed \
                        and any(self.holds(key, lvl) for lvl in range(self.levels)):
                    self.doomed.share(key, None)
                hs = holders[key] = set()
            hs.add(s)
            self.doomed.spare(key)
        self._tracked += len(new) - len(old)
        s.keys = new
        if s.retained:
            self.quota.remove(s.name[0], gone, s.weight)
            self.quota.add(s.name[0], added, s.weight)
            order = self._order  # an active session's saves extend it live, without a rebuild
            if order is not None and (not s.active or any(key in order.rank for key in added)
                                      or any(self.quota.retains(key) for key in gone)):
                self._order = None

    def _retain(self, s: Session, retained: bool) -> None:
        if retained == s.retained:
            return
        s.retained = retained
        self.retained += 1 if retained else -1
        (self.quota.add if retained else self.quota.remove)(s.name[0], s.keys, s.weight)
        self._order = None

    def _trim(self) -> None:
        """Forget the least recently hinted sessions while they hold too many chunks in all."""
        while self._tracked > MAX_TRACKED_KEYS and len(self._sessions) > 1:
            self._drop(next(iter(self._sessions.values())), doom=False)

    def _drop(self, s: Session, *, doom: bool, done: bool = False) -> None:
        """Forget session ``s``; ``doom``: it is dead, and its chunks no other session holds and
        no request of no session shares go first (deepest first) -- with ``done``, only those
        its done request used, and only that request's late saves."""
        self._retain(s, False)
        del self._sessions[s.name]
        self._tracked -= len(s.keys)
        for use in itertools.chain(s.uses, s.active):  # an active use may have left ``uses``
            if self._by_use.get(use) is s:
                del self._by_use[use]
                if doom and (not done or use == s.done_use):
                    self._dead_uses[use] = None
        while len(self._dead_uses) > MAX_DEAD_USES:
            self._dead_uses.popitem(last=False)
        own = set(s.done_keys) if done else None
        for key in reversed(s.keys):
            holders = self.holders.get(key)
            if holders is None:
                continue
            holders.discard(s)
            if not holders:
                del self.holders[key]
                shared = self.doomed.released(key)
                if doom and not shared and (own is None or key in own):
                    self.doomed.doom(key)
        self._order = None
