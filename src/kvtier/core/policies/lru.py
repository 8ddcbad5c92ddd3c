"""``lru``: least recently used, the baseline."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used, with a conversation's later chunks evicted before its earlier ones.

    A chunk whose prefix is gone can never hit, so when a sequence is touched its chunks are
    stamped last-to-first: the first chunk becomes the most recent and the deepest chunk is the
    first of that sequence to go (vLLM's free-block queue does the same).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        order = self._order
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        for key in self._order:
            if evictable(key):
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)
