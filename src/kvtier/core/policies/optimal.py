"""``optimal``: Belady's furthest-next-use, given the whole future of a trace. A ceiling only.

It needs :attr:`TierContext.future` (every key's request numbers, in service order) and the
scheduler's ``begin`` calls to know where in the trace it is, so it cannot run in a live store:
building it without a future raises. Prefix-aware: a chunk is never needed before its prefix
(a request that uses it uses its prefix), so among chunks needed equally late, or never again,
the deepest goes first, and a chunk never needed again is not admitted at all.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_right
from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.attentionstore import LOOKAHEAD
from kvtier.core.policies.base import EvictionPolicy, FutureUses, TierContext

NEVER = 1 << 62


class OptimalPolicy(EvictionPolicy):
    lookahead = LOOKAHEAD
    """It knows the future anyway; the look-ahead is there so it gets the same prefetching as
    the policies it bounds."""

    def __init__(self, context: TierContext) -> None:
        if context.future is None:
            raise ValueError(
                "policy 'optimal' needs the whole future of a trace; it is an offline bound "
                "for `kvtier replay`, not a live policy"
            )
        self._future: FutureUses = context.future
        self._seq = 0
        self._resident: dict[ChunkKey, int] = {}  # key -> next use it was queued with
        self._depth: dict[ChunkKey, int] = {}
        self._heap: list[tuple[int, int, int, ChunkKey]] = []  # (-next use, -depth, tie, key)
        self._tie = itertools.count()

    def _next_use(self, key: ChunkKey) -> int:
        uses = self._future.get(key, ())
        i = bisect_right(uses, self._seq)
        return uses[i] if i < len(uses) else NEVER

    def _push(self, key: ChunkKey) -> None:
        nxt = self._next_use(key)
        self._resident[key] = nxt
        heapq.heappush(self._heap, (-nxt, -self._depth.get(key, 0), next(self._tie), key))

    def begin(self, seq: int, now: float) -> None:
        self._seq = seq

    def admit(self, key: ChunkKey, position: int | None) -> bool:
        return self._next_use(key) != NEVER

    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        self._push(key)

    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        resident, depth = self._resident, self._depth
        for i, key in enumerate(keys):
            depth[key] = start + i
            if key in resident and resident[key] != self._next_use(key):
                self._push(key)

    def remove(self, key: ChunkKey) -> None:
        self._resident.pop(key, None)

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        heap, resident = self._heap, self._resident
        aside: list[tuple[int, int, int, ChunkKey]] = []
        found: ChunkKey | None = None
        while heap:
            entry = heap[0]
            key = entry[3]
            if resident.get(key) != -entry[0]:
                heapq.heappop(heap)  # stale: removed, or queued again with a later next use
                continue
            if evictable(key):
                found = key
                break
            aside.append(heapq.heappop(heap))
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def __len__(self) -> int:
        return len(self._resident)
