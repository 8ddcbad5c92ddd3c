"""Which tiers hold which chunks.

The index is the store's single source of truth for lookup. A chunk may be held by several tiers
at once (a chunk promoted from SSD to DRAM keeps its SSD copy, so demoting it again costs no
write). Tiers are identified by their level: 0 is the fastest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest run of held chunks from the first; ``levels[i]`` is the fastest tier of chunk i."""

    keys: list[ChunkKey]
    levels: list[int]

    def __len__(self) -> int:
        return len(self.keys)


class ChunkIndex:
    """key -> bitmask of tier levels holding the chunk, and the chunk's position in its
    sequence where known. Not thread-safe: the store locks."""

    def __init__(self) -> None:
        self._where: dict[ChunkKey, int] = {}
        self._position: dict[ChunkKey, int] = {}

    def add(self, key: ChunkKey, level: int, position: int | None = None) -> None:
        self._where[key] = self._where.get(key, 0) | (1 << level)
        if position is not None:
            self._position[key] = position

    def discard(self, key: ChunkKey, level: int) -> None:
        mask = self._where.get(key, 0) & ~(1 << level)
        if mask:
            self._where[key] = mask
        else:
            self._where.pop(key, None)
            self._position.pop(key, None)

    def position(self, key: ChunkKey) -> int | None:
        """The chunk's index in its sequence, if known (recorded when it was added)."""
        return self._position.get(key)

    def levels(self, key: ChunkKey) -> list[int]:
        mask = self._where.get(key, 0)
        return [lvl for lvl in range(mask.bit_length()) if mask >> lvl & 1]

    def fastest(self, key: ChunkKey) -> int | None:
        mask = self._where.get(key, 0)
        return (mask & -mask).bit_length() - 1 if mask else None

    def holds(self, key: ChunkKey, level: int) -> bool:
        return bool(self._where.get(key, 0) >> level & 1)

    def longest_prefix(self, keys: Sequence[ChunkKey]) -> PrefixHit:
        where = self._where
        hit_levels: list[int] = []
        for key in keys:
            mask = where.get(key)
            if not mask:
                break
            hit_levels.append((mask & -mask).bit_length() - 1)
        return PrefixHit(keys=list(keys[: len(hit_levels)]), levels=hit_levels)

    def count(self, level: int) -> int:
        return sum(1 for mask in self._where.values() if mask >> level & 1)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(list(self._where))
