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

    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        """Prefix-aware: along a sequence a chunk is worth at least any later chunk (losing it
        loses them), so a sequence's chunks share the deepest one's saving, and among equal
        rates the deepest goes first."""
        ctx = self._ctx
        saving = 0.0
        for i in range(len(keys) - 1, -1, -1):
            key, pos = keys[i], start + i
            own = ctx.miss_saving_s(pos) if cost_s is None else cost_s - ctx.chunk_load_s
            saving = max(saving, own, 0.0)
            self._depth[key] = pos
            self._saving[key] = saving

    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        self._held[key] = None

    def remove(self, key: ChunkKey) -> None:
        self._held.pop(key, None)

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        found, lowest = None, (float("inf"), 0)
        fresh = never = None
        for key in self._held:
            if not evictable(key):
                continue
            depth, nxt = self._depth.get(key, 0), self._next_use(key)
            if nxt == NEVER:
                if never is None or depth > self._depth.get(never, 0):
                    never = key
                continue
            # A chunk being saved is touched right after its insert: until then it stays.
            rate = (self._saving.get(key, float("inf")) / max(nxt - self._seq, 1), -depth)
            if rate < lowest:
                found, lowest = key, rate
            elif fresh is None and rate[0] == float("inf"):
                fresh = key
        return never or found or fresh

    def __len__(self) -> int:
        return len(self._held)
