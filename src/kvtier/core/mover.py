"""The contract between a :class:`~kvtier.core.placement.Placement` and what moves its bytes:
a :class:`Move`, its outcome (:class:`Copied`), an entry's :class:`Shape`, and the
:class:`Mover` protocol that carries moves out."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvtier.core.keys import ChunkKey


class Copied(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    """Not written (no room after all, an I/O error at the destination): nothing changes."""
    SOURCE_LOST = "source_lost"
    """The source copy could not be read (damaged, gone): the placement forgets it."""
    QUEUED = "queued"
    """Handed to a background writer (the remote tier); the mover reports the chunk with
    :meth:`Placement.added` once it is there."""
    PRESENT = "present"
    """The destination already holds the chunk (another thread's copy of it finished first)."""


class Shape(NamedTuple):
    """The size of an entry and of its independently checksummed parts (a layer of a chunk)."""

    nbytes: int
    segment_bytes: int


@dataclass(frozen=True, slots=True)
class Move:
    """Copy chunk ``key`` from tier ``src`` into tier ``dst`` (levels, 0 is DRAM)."""

    key: ChunkKey
    src: int
    dst: int


class Mover(Protocol):
    """Carries out a :class:`Placement`'s moves; levels count from 0 (DRAM). ``entry``: the shape
    of the entry room is wanted for (None: the store's chunk), for tiers whose room depends on
    it; the placement passes it along without looking at it."""

    def has_room(self, level: int, count: int = 1, entry: Shape | None = None) -> bool:
        """Whether tier ``level`` can take ``count`` more entries now."""

    def fits(self, level: int, count: int, entry: Shape | None = None) -> bool:
        """Whether tier ``level`` could hold ``count`` entries at all (when empty)."""

    def entry_of(self, level: int, key: ChunkKey) -> Shape | None:
        """The shape of the chunk held at ``level`` (None: the store's chunk)."""

    def evictable(self, level: int, key: ChunkKey, entry: Shape | None = None) -> bool:
        """Whether ``key`` may be evicted from ``level`` now to make room (not pinned, not being
        written or moved)."""

    def evict_group(self, level: int, key: ChunkKey, entry: Shape | None = None) -> list[ChunkKey]:
        """The chunks to evict for victim ``key``: ``[key]``, or every chunk of the memory region
        holding it when only a whole region can make room for ``entry``. :meth:`group_done`
        follows once they are evicted."""

    def group_done(self, level: int, group: Sequence[ChunkKey]) -> None:
        """The chunks :meth:`evict_group` named have been evicted (or kept: pinned meanwhile)."""

    def is_pinned(self, level: int, key: ChunkKey) -> bool: ...

    def pin(self, level: int, key: ChunkKey) -> bool:
        """Pin a held chunk against deletion; False if the tier does not hold it."""

    def pin_many(self, level: int, keys: Sequence[ChunkKey]) -> list[bool]:
        """``pin`` each of ``keys`` (one round trip to the remote tier)."""

    def unpin(self, level: int, key: ChunkKey) -> None: ...

    def copy(self, move: Move) -> Copied:
        """Carry out ``move`` (``dst`` has room)."""

    def copy_many(self, moves: Sequence[Move]) -> list[Copied]:
        """``copy`` each of ``moves`` (same ``src`` and ``dst``, which has room for all), in one
        batch where the tiers can (one round trip to the remote tier)."""

    def drop(self, key: ChunkKey, level: int) -> None:
        """Delete the (unpinned) chunk from tier ``level``."""
