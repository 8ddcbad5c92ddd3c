"""Doomed chunks: those of dead hinted sessions (done, or expired) that no remembered session
holds, which every tier evicts first (:class:`~kvtier.core.sessions.SessionBook` dooms them,
:class:`~kvtier.core.policies.hinted.HintedPolicy` evicts them). Kept per tier, in the order
they were doomed, so a tier finds its own without scanning the others'.

Some chunks sessions hold are *shared*, never doomed: a request of no session used them while a
session held them (a system prompt unhinted traffic shares too), or they were stored already
when a session first named them. A request's lookup may come before its hint, so a mark names
the request that made it, and the request's hint takes back what only it marked. A mark lasts
while some session holds the chunk. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvtier.core.keys import ChunkKey

SHARED = -1
"""A shared chunk's mark once more than one request (or one without a number) used it."""


class DoomedChunks:
    """The doomed chunks of ``levels`` tiers; ``holds(key, level)``: whether a tier holds one."""

    def __init__(self, levels: int, holds: Callable[[ChunkKey, int], bool]) -> None:
        self.levels = levels
        self.holds = holds
        self._all: set[ChunkKey] = set()
        self._at: list[dict[ChunkKey, None]] = [{} for _ in range(levels)]
        self._shared: dict[ChunkKey, int] = {}
        """Held chunks that are shared: the request that marked it, or :data:`SHARED`."""

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

    # -- shared chunks ------------------------------------------------------------------------
    def share(self, key: ChunkKey, use: int | None) -> None:
        """Request ``use`` of no session (None: one without a number) used ``key``, which a
        session holds."""
        was = self._shared.get(key)
        if was is None:
            self._shared[key] = SHARED if use is None else use
        elif was != use:
            self._shared[key] = SHARED

    def unshare(self, keys: list[ChunkKey], use: int) -> None:
        """Request ``use`` belongs to a session after all (its hint came after its lookup): the
        chunks only it marked are not shared."""
        if self._shared:
            for key in keys:
                if self._shared.get(key) == use:
                    del self._shared[key]

    def released(self, key: ChunkKey) -> bool:
        """No session holds ``key`` any more: its mark is forgotten; whether it was shared."""
        return self._shared.pop(key, None) is not None
