"""``attentionstore``: AttentionStore's scheduler-aware placement (Gao et al., ATC'24).

The scheduler knows the queue of requests that have arrived but are not served yet. Their chunks
are prefetched from SSD into DRAM ahead of use (the scheduler does that for every policy with a
look-ahead), and DRAM evicts first the chunks no queued request needs (least recently used
first), then, only if every candidate is needed, the one needed farthest in the future. Eviction
from DRAM demotes to SSD (the store's rule), it does not drop.

The window is the whole queue, not a fixed number of requests: behind a deep queue the
requests about to be served are the ones that have waited longest, so their chunks are the
least recently used, and a window of a few requests would let LRU's order evict exactly them.
So this policy asks for every queued request (:data:`QUEUE_LOOKAHEAD`), as the live store
announces them (``TieredCache.queued``). Both choices of a victim are kept in lazy heaps, so an
eviction costs a logarithm of the tier's size (amortized, plus the pinned chunks it steps
over), not a scan of it, however many chunks the queue needs; a touch or a hint pays a heap
push per chunk.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.lru import LRUPolicy
from kvtier.core.policies.window import QueueWindow, top_evictable

LOOKAHEAD = 32
"""Queued requests the offline ``optimal`` hears of (it knows the future anyway; the hints only
drive the replay's prefetch)."""
QUEUE_LOOKAHEAD = 1 << 30
"""``attentionstore``'s, ``cost``'s and ``returns``': every queued request, as the live store
hears of them."""


class AttentionStorePolicy(LRUPolicy):
    lookahead = QUEUE_LOOKAHEAD

    def __init__(self) -> None:
        super().__init__()
        self._window = QueueWindow()
        self._clock = 0
        self._stamp: dict[ChunkKey, int] = {}  # key in the tier -> when it was last used
        self._free: list[tuple[int, ChunkKey]] = []  # (stamp, key): keys no queued request needs
        self._far: list[tuple[int, int, ChunkKey]] = []  # (-need, stamp, key): keys it needs

    # -- the heaps: an entry is live while its key's stamp and need are the ones it holds ------
    def _file(self, key: ChunkKey) -> None:
        stamp = self._stamp[key]
        need = self._window.next_need(key)
        if need is None:
            heapq.heappush(self._free, (stamp, key))
        else:
            heapq.heappush(self._far, (-need, stamp, key))
        if len(self._free) + len(self._far) > 4 * len(self._stamp) + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        window, free, far = self._window, [], []
        for key, stamp in self._stamp.items():
            need = window.next_need(key)
            if need is None:
                free.append((stamp, key))
            else:
                far.append((-need, stamp, key))
        heapq.heapify(free)
        heapq.heapify(far)
        self._free, self._far = free, far

    def _stamp_now(self, key: ChunkKey) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        self._file(key)

    # -- the policy ---------------------------------------------------------------------------
    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        super().insert(key, position)
        self._stamp_now(key)

    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        stamp = self._stamp
        for key in reversed(keys):  # as LRU: the first chunk ends the most recent
            if key in stamp:
                self._order.move_to_end(key)
                self._stamp_now(key)

    def remove(self, key: ChunkKey) -> None:
        super().remove(key)
        self._stamp.pop(key, None)

    def begin(self, seq: int, now: float) -> None:
        for key in self._window.leave_through(seq):
            if key in self._stamp:
                self._file(key)

    def hint(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        for key in self._window.join(seq, keys):
            if key in self._stamp:
                self._file(key)

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        stamp, window = self._stamp, self._window
        found = top_evictable(self._free, evictable,
                          lambda e: stamp.get(e[1]) == e[0] and window.next_need(e[1]) is None)
        if found is None:  # every candidate is needed: the farthest, the least recent among equals
            found = top_evictable(self._far, evictable,
                              lambda e: stamp.get(e[2]) == e[1] and window.next_need(e[2]) == -e[0])
        return found
