"""Doomed chunks: those of dead hinted sessions (done, or expired) that no remembered session
holds, which every tier evicts first (:class:`~kvtier.core.sessions.SessionBook` dooms them,
:class:`~kvtier.core.policies.hinted.HintedPolicy` evicts them). Kept per tier, in the order
they were doomed, so a tier finds its own without scanning the others'. Not thread-safe: the
store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvtier.core.keys import ChunkKey


class DoomedChunks:
    """The doomed chunks of ``levels`` tiers; ``holds(key, level)``: whether a tier holds one."""

    def __init__(self, levels: int, holds: Callable[[ChunkKey, int], bool]) -> None:
        self.levels = levels
        self.holds = holds
        self._all: set[ChunkKey] = set()
        self._at: list[dict[ChunkKey, None]] = [{} for _ in range(levels)]

    def __bool__(self) -> bool:
        return bool(self._all)

    def __contains__(self, key: object) -> bool:
        return key in self._all

    def keys(self) -> set[ChunkKey]:
        return set(self._all)

    def doom(self, key: ChunkKey) -> None:
        """``key`` goes first from every tier that holds it (nothing if none does)."""
        at = [lvl for lvl in range(self.levels) if self.holds(key, lvl)]
        if at:
            self._all.add(key)
            for lvl in at:
                self._at[lvl][key] = None

    def spare(self, key: ChunkKey) -> None:
        """``key`` is no longer doomed (a live session holds it, a request used it again)."""
        if key in self._all:
            self._all.discard(key)
            for doomed in self._at:
                doomed.pop(key, None)

    def inserted(self, key: ChunkKey, level: int) -> None:
        """A doomed chunk landed in another tier (demoted): doomed there too."""
        if key in self._all:
            self._at[level][key] = None

    def removed(self, key: ChunkKey, level: int) -> None:
        """Tier ``level`` dropped ``key``; forgotten once no tier holds it."""
        self._at[level].pop(key, None)
        if key in self._all and not any(self.holds(key, lvl) for lvl in range(self.levels)):
            self._all.discard(key)

    def at(self, level: int) -> Iterator[ChunkKey]:
        """Those tier ``level`` holds, first doomed first. Change nothing while iterating."""
        return iter(self._at[level])
