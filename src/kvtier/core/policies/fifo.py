"""``fifo``: first in, first out, a baseline that ignores reuse."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.lru import LRUPolicy


class FIFOPolicy(LRUPolicy):
    """Evicts the chunk that entered the tier first; a hit changes nothing.

    The order is the order of :meth:`insert` calls, with one tie-break: the chunks inserted
    together by one save (or one load's promotions) are ordered by the touch that follows them
    (the store touches what it inserts right after), deepest chunk first, as in ``lru``: a chunk
    whose prefix is gone can never hit, so the oldest sequence loses its end before its start.
    Only that first touch reorders; any touch ends the chunks' freshness, so a later hit never
    moves them. A key inserted again while still held keeps its place (it never left the tier).
    """

    def __init__(self) -> None:
        super().__init__()  # its order, removal and victim; only insert and touch differ
        self._fresh: list[ChunkKey] = []
        """Inserted since the last touch."""

    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        if key not in self._order:
            self._order[key] = None
            self._fresh.append(key)

    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        if not self._fresh:
            return
        fresh, order = set(self._fresh), self._order
        self._fresh.clear()
        for key in reversed(keys):
            if key in fresh and key in order:
                order.move_to_end(key)
