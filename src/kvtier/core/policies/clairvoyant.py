"""``clairvoyant``: the cost-aware offline heuristic, given the whole future of a trace. A ceiling
for small simulations only.

Belady (``optimal``) keeps the chunks used again soonest, whatever they save. With objects whose
misses cost very different times (a KV chunk's prefill against an index rebuild) that is no
longer the best order; this policy evicts the resident whose saving per request until its next
use is the smallest (one never used again first). It is a heuristic, not a proven bound, and
costs a scan of the residents per eviction: fine for the few thousand slots of
``kvtier bench objects``, too slow for a full trace replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.optimal import NEVER, OptimalPolicy


class ClairvoyantPolicy(OptimalPolicy):
    def __init__(self, context) -> None:
        super().__init__(context)
        self._ctx = context
        self._saving: dict[ChunkKey, float] = {}
        self._held: dict[ChunkKey, None] = {}

    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None) -> None:
        ctx = self._ctx
        for pos, key in enumerate(keys):
            self._depth[key] = pos
            self._saving[key] = ctx.miss_saving_s(pos) if cost_s is None else cost_s - ctx.chunk_load_s

    def insert(self, key: ChunkKey) -> None:
        self._held[key] = None

    def remove(self, key: ChunkKey) -> None:
        self._held.pop(key, None)

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        found, lowest = None, float("inf")
        fresh = None
        for key in self._held:
            if not evictable(key):
                continue
            nxt = self._next_use(key)
            if nxt == NEVER:
                return key
            # A chunk being saved is touched right after its insert: until then it stays.
            rate = self._saving.get(key, float("inf")) / max(nxt - self._seq, 1)
            if rate < lowest:
                found, lowest = key, rate
            elif fresh is None and rate == float("inf"):
                fresh = key
        return found if found is not None else fresh

    def __len__(self) -> int:
        return len(self._held)
