"""The look-ahead window: which chunks the queued requests need, and how soon."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey


class QueueWindow:
    """key -> request numbers of the queued requests that need it, soonest first.

    Fed by a policy's ``hint`` (a request joins) and ``begin`` (a request leaves: it is being
    served). Requests are served in the order of their numbers, so each key's numbers stay sorted
    by appending on join and popping from the left on leave (a request that joins after a
    higher-numbered one is appended all the same: its key's ``next_need`` stays the earlier
    joiner's until that one leaves).
    """

    def __init__(self) -> None:
        self._need: dict[ChunkKey, deque[int]] = {}
        self._queued: dict[int, list[ChunkKey]] = {}
        self._in_order = True  # requests joined in ascending numbers: the oldest come first

    def join(self, seq: int, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Request ``seq`` is queued and needs ``keys``. Returns the keys no queued request
        needed before (their :meth:`next_need` is now ``seq``)."""
        if seq in self._queued:
            return []
        unique = list(dict.fromkeys(keys))
        if self._queued and seq < next(reversed(self._queued)):
            self._in_order = False
        self._queued[seq] = unique
        need = self._need
        fresh: list[ChunkKey] = []
        for key in unique:
            seqs = need.get(key)
            if seqs is None:
                need[key] = deque((seq,))
                fresh.append(key)
            else:
                seqs.append(seq)
        return fresh

    def leave_through(self, seq: int) -> list[ChunkKey]:
        """Requests numbered up to ``seq`` are served (or abandoned): forget them. Returns the
        keys whose :meth:`next_need` changed (to a later request, or to None)."""
        if not self._queued:
            return []
        need = self._need
        changed: list[ChunkKey] = []
        if self._in_order:  # a deep queue: touch only the served ones
            gone = []
            for s in self._queued:
                if s > seq:
                    break
                gone.append(s)
        else:
            gone = [s for s in self._queued if s <= seq]
        for done in gone:
            for key in self._queued.pop(done):
                seqs = need.get(key)
                if seqs is None:
                    continue
                first = seqs[0]
                try:
                    seqs.remove(done)
                except ValueError:
                    continue
                if not seqs:
                    del need[key]
                    changed.append(key)
                elif seqs[0] != first:
                    changed.append(key)
        if not self._queued:
            self._in_order = True
        return list(dict.fromkeys(changed)) if len(gone) > 1 else changed

    def next_need(self, key: ChunkKey) -> int | None:
        """Number of the soonest queued request needing ``key``; None if none does."""
        seqs = self._need.get(key)
        return seqs[0] if seqs else None

    def __contains__(self, key: object) -> bool:
        return key in self._need

    def __len__(self) -> int:
        return len(self._queued)


def top_evictable(heap: list[tuple], evictable: Callable[[ChunkKey], bool],
                  live: Callable[[tuple], bool]) -> ChunkKey | None:
    """The key (an entry's last field) of the first live, evictable entry of a lazy min-heap,
    left in place; stale entries on the way are dropped, unevictable (pinned) ones kept."""
    aside = []
    found = None
    try:
        while heap:
            entry = heap[0]
            if not live(entry):
                heapq.heappop(heap)
                continue
            if evictable(entry[-1]):
                found = entry[-1]
                break
            aside.append(heapq.heappop(heap))
    finally:
        for entry in aside:
            heapq.heappush(heap, entry)
    return found
