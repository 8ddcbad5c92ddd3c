"""One hinted session as the session book (:mod:`kvtier.core.sessions`) keeps it: its chunks,
its requests, and when it is expected back -- which ranks its chunks for eviction; and what the
book reports: its counters, a session due in DRAM. Not thread-safe: the store calls it under its
lock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape

MIN_GRACE_S = 5.0
"""A session not back ``max(MIN_GRACE_S, return_s)`` after it was expected is overdue: ranked by
its retain expiry from then, and not staged."""


@dataclass(slots=True)
class HintStats:
    accepted: int = 0
    refused: int = 0
    """Hints asking for retention that their tenant's quota (or the global cap) refused, and
    retained sessions whose saves would have taken them past it."""
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
class Session:
    name: tuple[str, str]
    """(quota tenant, session id)."""
    weight: int
    """Bytes of one of its chunks (for the quota)."""
    keys: list[ChunkKey] = field(default_factory=list)
    retain_s: float = 0.0
    return_s: float | None = None
    retained: bool = False
    done_use: int | None = None
    done_keys: list[ChunkKey] = field(default_factory=list)
    """The chunks the ``done`` request itself used (its prompt, then its saves): what its end
    dooms."""
    active: dict[int, float] = field(default_factory=dict)
    """Its requests queued or running, each with when it times out."""
    uses: deque[int] = field(default_factory=deque)
    """Its latest requests, whose saves still extend it."""
    finished_at: float | None = None
    finish: int = -1
    """Which finish its pending expiry and staging were made at (a later one makes them stale)."""
    retry_s: float = 0.0
    """How long after its next staging it is asked again."""
    staged_for: float | None = None
    entry: Shape | None = None
    key_tenant: str | None = None

    def expected(self) -> float:
        """When it is expected back (-inf: now, a request of it is queued or running)."""
        if self.active or self.finished_at is None:
            return -math.inf
        return self.finished_at + (self.return_s if self.return_s is not None else self.retain_s)

    def overdue_at(self) -> float:
        """When it is overdue if not back by then (inf: never; without ``return_s`` it is
        expected at its retain expiry, when it expires)."""
        back = self.expected()
        if self.return_s is None or back == -math.inf:
            return math.inf
        return back + max(MIN_GRACE_S, self.return_s)

    def rank(self, now: float) -> float:
        """Where it ranks among retained sessions at ``now`` (its chunks go farthest first):
        :meth:`expected`, once overdue its retain expiry."""
        if self.finished_at is not None and now >= self.overdue_at():
            return self.finished_at + self.retain_s
        return self.expected()
