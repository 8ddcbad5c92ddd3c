"""``attentionstore``: AttentionStore's scheduler-aware placement (Gao et al., ATC'24).

The scheduler knows the queue of requests that have arrived but are not served yet. Their chunks
are prefetched from SSD into DRAM ahead of use (the scheduler does that for every policy with a
look-ahead), and DRAM evicts first the chunks no queued request needs (least recently used
first), then, only if every candidate is needed, the one needed farthest in the future. Eviction
from DRAM demotes to SSD (the store's rule), it does not drop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.lru import LRUPolicy
from kvtier.core.policies.window import QueueWindow

LOOKAHEAD = 32


class AttentionStorePolicy(LRUPolicy):
    lookahead = LOOKAHEAD

    def __init__(self) -> None:
        super().__init__()
        self._window = QueueWindow()

    def begin(self, seq: int, now: float) -> None:
        self._window.leave_through(seq)

    def hint(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        self._window.join(seq, keys)

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        window = self._window
        farthest: ChunkKey | None = None
        farthest_seq = -1
        for key in self._order:
            if not evictable(key):
                continue
            need = window.next_need(key)
            if need is None:
                return key
            if need > farthest_seq:  # strict: among equals the least recent goes first
                farthest, farthest_seq = key, need
        return farthest
