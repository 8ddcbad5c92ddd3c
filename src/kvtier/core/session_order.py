"""The retained sessions' chunks in eviction order, as one tier's victim walk reads them
(:class:`~kvtier.core.sessions.SessionBook` builds it,
:class:`~kvtier.core.policies.hinted.HintedPolicy` asks it for victims).

Built at once from the retained sessions ranked farthest first, and kept until the book changes
what it was built from (a hint, a finish, an expiry, a session's chunks) or a session it holds
becomes overdue (``valid_until``):

- *idle* sessions (expected back at a finite time) are laid out flat: each chunk once, with the
  session expected back soonest of those holding it, the session expected back farthest first
  and its deepest chunk first. A victim is the first entry the tier holds and may evict; each
  tier keeps a cursor past the entries it was found not to hold (moved back when the tier gets
  one of them again), so successive victims cost what they skip once, not each time;
- *active* sessions (a request queued or running: back now) rank last and are walked live, so
  that their saves -- most of the chunks a busy store writes -- extend them without a rebuild.
  A chunk an active session holds ranks with it, never among the idle ones.

A build costs one pass over the idle sessions' chunks; a victim, nothing that grows with the
number of sessions sharing a chunk. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.session_state import Session


class RetainedOrder:
    """``idle``: (rank, chunks) of each idle retained session, farthest first; ``active``: the
    active retained sessions, in the order their chunks go; ``valid_until``: when a rank it was
    built with changes (the soonest overdue time), rebuilt from then."""

    def __init__(self, levels: int, idle: Sequence[tuple[float, Sequence[ChunkKey]]],
                 active: Sequence[Session], valid_until: float = math.inf) -> None:
        self.valid_until = valid_until
        self.active = list(active)
        hot = {key for s in self.active for key in s.keys}
        soonest: dict[ChunkKey, float] = {}
        for rank, keys in idle:
            for key in keys:
                if key not in hot and soonest.get(key, math.inf) > rank:
                    soonest[key] = rank
        self.entries: list[tuple[ChunkKey, float]] = []
        self.rank: dict[ChunkKey, int] = {}
        """chunk -> its index in ``entries``."""
        for rank, keys in idle:
            for key in reversed(keys):  # deepest first
                if soonest.get(key) == rank and key not in self.rank:
                    self.rank[key] = len(self.entries)
                    self.entries.append((key, rank))
        self.cursor = [0] * levels
        """Per tier: the entries before it were found not held there."""

    @classmethod
    def of(cls, levels: int, sessions: Iterable[Session], now: float) -> RetainedOrder:
        """The order of the retained ones of ``sessions`` at ``now`` (until one becomes overdue)."""
        ranked = sorted(((s.rank(now), s) for s in sessions if s.retained),
                        key=lambda e: e[0], reverse=True)
        idle = [(rank, s) for rank, s in ranked if rank != -math.inf]
        active = [s for rank, s in ranked if rank == -math.inf]
        overdue = min((t for _, s in idle if (t := s.overdue_at()) > now), default=math.inf)
        return cls(levels, [(rank, s.keys) for rank, s in idle], active, overdue)

    def inserted(self, key: ChunkKey, level: int) -> None:
        """Tier ``level`` got ``key``: its cursor comes back to it if it had passed it."""
        i = self.rank.get(key)
        if i is not None and i < self.cursor[level]:
            self.cursor[level] = i

    def victim(self, level: int, evictable: Callable[[ChunkKey], bool],
               holds: Callable[[ChunkKey, int], bool], ceiling: float | None) -> ChunkKey | None:
        """The first chunk in the order that tier ``level`` holds and ``evictable`` allows;
        with a ``ceiling``, only among those ranked after it (never an active session's)."""
        entries, n = self.entries, len(self.entries)
        i = self.cursor[level]
        first_held: int | None = None
        while i < n:
            key, rank = entries[i]
            if ceiling is not None and rank <= ceiling:
                break
            if holds(key, level):
                if first_held is None:
                    first_held = i
                if evictable(key):
                    self.cursor[level] = first_held
                    return key
            i += 1
        self.cursor[level] = first_held if first_held is not None else i
        if ceiling is not None:
            return None
        seen: set[ChunkKey] = set()
        for s in self.active:
            for key in reversed(s.keys):
                if key not in seen:
                    seen.add(key)
                    if holds(key, level) and evictable(key):
                        return key
        return None
