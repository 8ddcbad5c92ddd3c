"""Eviction policies: small strategy objects chosen by name from :data:`POLICIES`.

A store keeps one policy instance per tier. The policy only orders keys; it never touches a tier
(the store asks it for candidates, skips the ones that are pinned, and moves the bytes).

Call order, per tier: ``insert`` when a chunk lands in the tier, ``touch`` when a sequence's
chunks are looked up, loaded or saved (keys in prefix order), ``remove`` when it leaves;
``victim`` names the key to evict next among those the store says it may evict (not pinned).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey


class EvictionPolicy(ABC):
    """Orders the chunks of one tier for eviction."""

    @abstractmethod
    def insert(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` are one sequence's chunks, in prefix order, that were just used."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        """The key to evict next among those for which ``evictable`` is true; None if none."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used, with a conversation's later chunks evicted before its earlier ones.

    A chunk whose prefix is gone can never hit, so when a sequence is touched its chunks are
    stamped last-to-first: the first chunk becomes the most recent and the deepest chunk is the
    first of that sequence to go (vLLM's free-block queue does the same).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, keys: Sequence[ChunkKey]) -> None:
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


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {sorted(POLICIES)}") from None
    return factory()
