"""Deadlines the session book waits for: a retained session's expiry and its staging, a hinted
request's time-out (:class:`~kvtier.core.sessions.SessionBook` keeps three of these).

An entry names what it is for (a session's name and the finish it was made at, a request's
number), never the session itself, so a dropped session is not held until its deadline (up to a
day). Entries a later change made stale are skipped when they come due, and dropped all at once
when they outnumber the live ones (twice ``live``, as the caller counts them, plus
:data:`SLACK`): a session that finishes ten times a second for a day leaves no trail. Not
thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

SLACK = 64
"""Stale entries tolerated beyond twice the live ones before the heap is compacted."""


class Deadlines(Generic[T]):
    """A min-heap of ``(when, item)``; ``live(when, item)`` says whether an entry still counts."""

    def __init__(self, live: Callable[[float, T], bool]) -> None:
        self.live = live
        self._heap: list[tuple[float, int, T]] = []
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, when: float, item: T, live_count: int) -> None:
        """Wait for ``when``; ``live_count``: how many entries may be live at most (compacted
        past twice that)."""
        heapq.heappush(self._heap, (when, next(self._tie), item))
        if len(self._heap) > 2 * live_count + SLACK:
            self._heap = [e for e in self._heap if self.live(e[0], e[2])]
            heapq.heapify(self._heap)

    def due(self, now: float) -> Iterator[tuple[float, T]]:
        """The live entries due by ``now``, soonest first, each taken off as it is yielded (push
        nothing while iterating)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, _, item = heapq.heappop(heap)
            if self.live(when, item):
                yield when, item
