"""Where chunks live: the placement rules the live store and trace replay share.

Bookkeeping apart from byte movement (vLLM's offload manager and its transfer handlers):
:class:`Placement` owns the chunk index and one policy per tier, and decides what is admitted,
evicted, demoted, promoted and dropped; a :class:`Mover` moves the bytes. The live store's mover
copies between real tiers (:mod:`kvtier.store`); ``kvtier replay``'s mover only counts chunks
against capacities. The same object, the same policies, the same rules:

- ``lookup``: the longest held prefix; touches its keys (every tier's policy is touched, even for
  keys its tier does not hold);
- a new chunk goes to DRAM once the DRAM policy ``admit`` s it (``room_for_new``);
- making room in a tier evicts its policy's ``victim`` among the chunks not pinned; an evicted
  chunk is demoted to the next tier (written there only if that tier does not hold it yet and its
  policy admits it; room is made there first, recursively), from the last tier it is dropped;
- ``source``: the tier to read a chunk from; a chunk found below DRAM is promoted into DRAM first
  (its lower copy stays, so demoting it again costs no write). The chunk is pinned in its tier
  while room is made, so the demotions that makes cannot evict it;
- ``prefetch``: promotes the held prefix of a queued request's chunks; ``promote_prefix`` (also
  used by the store's load) promotes runs of consecutive chunks held in the same lower tier
  in one batch (``Mover.copy_many``: one round trip to the remote tier, not one per chunk);
- scheduler hooks ``begin`` and ``hint`` reach every policy (see
  :mod:`kvtier.core.policies.base`).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.core.index import ChunkIndex, PrefixHit
from kvtier.core.keys import ChunkKey
from kvtier.core.policies.base import EvictionPolicy


class Copied(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    """Not written (no room after all, an I/O error at the destination): nothing changes."""
    SOURCE_LOST = "source_lost"
    """The source copy could not be read (damaged, gone): the placement forgets it."""
    QUEUED = "queued"
    """Handed to a background writer (the remote tier); the mover reports the chunk with
    :meth:`Placement.added` once it is there."""


class Mover(Protocol):
    """Moves chunks between tiers for a :class:`Placement`; levels count from 0 (DRAM)."""

    def has_room(self, level: int, count: int = 1) -> bool:
        """Whether tier ``level`` can take ``count`` more chunks now."""

    def fits(self, level: int, count: int) -> bool:
        """Whether tier ``level`` could hold ``count`` chunks at all (when empty)."""

    def is_pinned(self, level: int, key: ChunkKey) -> bool: ...

    def pin(self, level: int, key: ChunkKey) -> bool:
        """Pin a held chunk against deletion; False if the tier does not hold it."""

    def pin_many(self, level: int, keys: Sequence[ChunkKey]) -> list[bool]:
        """``pin`` each of ``keys`` (one round trip to the remote tier)."""

    def unpin(self, level: int, key: ChunkKey) -> None: ...

    def copy(self, key: ChunkKey, src: int, dst: int) -> Copied:
        """Write the chunk held at ``src`` into ``dst`` (which has room)."""

    def copy_many(self, keys: Sequence[ChunkKey], src: int, dst: int) -> list[Copied]:
        """``copy`` each of ``keys`` (``dst`` has room for all), in one batch where the tiers
        can (one round trip to the remote tier)."""

    def drop(self, key: ChunkKey, level: int) -> None:
        """Delete the (unpinned) chunk from tier ``level``."""


@dataclass(slots=True)
class PlacementStats:
    evictions: list[int]
    """Per level: chunks evicted from it."""
    writes_down: list[int]
    """Per level: chunks demoted (or written through) into it."""
    promotions: int = 0
    refused: int = 0
    """Chunks a policy did not admit: into DRAM (counted with the rest of their sequence), or
    into a lower tier on demotion (dropped there instead)."""
    dropped: int = 0
    """New chunks that found no room (everything pinned)."""
    lost: int = 0
    """Copies found damaged or gone when read, and forgotten."""
    prefetched: int = 0
    prefetch_hits: int = 0
    """Prefetched chunks later read from DRAM (each counted once)."""

    @classmethod
    def for_levels(cls, levels: int) -> PlacementStats:
        return cls(evictions=[0] * levels, writes_down=[0] * levels)


class Placement:
    """The index and one policy per tier (fastest first), moving chunks through ``mover``."""

    def __init__(self, policies: Sequence[EvictionPolicy], mover: Mover) -> None:
        if not policies:
            raise ValueError("a placement needs at least one tier")
        self.policies = list(policies)
        self.levels = len(self.policies)
        self.mover = mover
        self.index = ChunkIndex()
        self.stats = PlacementStats.for_levels(self.levels)
        self._prefetched: set[ChunkKey] = set()

    @property
    def lookahead(self) -> int:
        """Queued requests the DRAM policy wants announced with :meth:`hint` (0: none)."""
        return self.policies[0].lookahead

    # -- scheduler hooks ----------------------------------------------------------------------
    def begin(self, seq: int, now: float) -> None:
        for policy in self.policies:
            policy.begin(seq, now)

    def hint(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        for policy in self.policies:
            policy.hint(seq, keys)

    # -- bookkeeping --------------------------------------------------------------------------
    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None) -> None:
        for policy in self.policies:
            policy.touch(keys, cost_s)

    def added(self, key: ChunkKey, level: int) -> None:
        """A chunk landed in tier ``level`` (a save committed, a tier reopened with it)."""
        if not self.index.holds(key, level):
            self.index.add(key, level)
            self.policies[level].insert(key)

    def forget(self, key: ChunkKey, level: int) -> None:
        """Tier ``level`` lost the chunk (damage found on read): it leaves the index."""
        if self.index.holds(key, level):
            self.index.discard(key, level)
            self.policies[level].remove(key)
            self.stats.lost += 1
        if level == 0:
            self._prefetched.discard(key)

    def lookup(self, keys: Sequence[ChunkKey], cost_s: float | None = None) -> PrefixHit:
        hit = self.index.longest_prefix(keys)
        self.touch(hit.keys, cost_s)
        return hit

    # -- placement ----------------------------------------------------------------------------
    def room_for_new(self, key: ChunkKey, position: int | None, remaining: int = 1) -> bool:
        """Admission and room in DRAM for new chunk ``position`` of a sequence; ``remaining``:
        chunks of the sequence from this one on (all count as refused or dropped on False)."""
        if not self.policies[0].admit(key, position):
            self.stats.refused += remaining
            return False
        if not self.make_room(0):
            self.stats.dropped += remaining
            return False
        return True

    def make_room(self, level: int, count: int = 1) -> bool:
        """Evict from tier ``level`` until it has room for ``count`` chunks; False if everything
        left is pinned."""
        while not self.mover.has_room(level, count):
            if not self.evict(level):
                return False
        return True

    def evict(self, level: int) -> bool:
        """Evict one chunk from tier ``level``, demoting it. False if none can go."""
        mover = self.mover
        key = self.policies[level].victim(lambda k: not mover.is_pinned(level, k))
        if key is None:
            return False
        self.demote(key, level)
        mover.drop(key, level)
        self.index.discard(key, level)
        self.policies[level].remove(key)
        self.stats.evictions[level] += 1
        if level == 0:
            self._prefetched.discard(key)
        return True

    def demote(self, key: ChunkKey, level: int) -> bool:
        """Write the chunk held at ``level`` into the next tier, unless that tier holds it,
        does not exist, or its policy does not admit it. Whether the next tier holds it now."""
        lower = level + 1
        if lower >= self.levels:
            return False
        if self.index.holds(key, lower):
            return True
        if not self.policies[lower].admit(key, None):
            self.stats.refused += 1
            return False
        if not self.mover.pin(level, key):
            return False
        try:
            if not self.make_room(lower):
                return False
            copied = self.mover.copy(key, level, lower)
        finally:
            self.mover.unpin(level, key)
        if copied is Copied.SOURCE_LOST:
            self.forget(key, level)
        if copied in (Copied.OK, Copied.QUEUED):
            self.stats.writes_down[lower] += 1
        if copied is not Copied.OK:
            return False  # queued: the mover reports it with `added` once it is there
        self.added(key, lower)
        return True

    def promote(self, key: ChunkKey, level: int) -> bool:
        """Copy a chunk from ``level`` into DRAM. False if there is no room or the read fails."""
        mover = self.mover
        if not mover.pin(level, key):
            return False
        try:  # pinned: making room in DRAM demotes into lower tiers, which must not evict it
            if not self.make_room(0):
                return False
            copied = mover.copy(key, level, 0)
        finally:
            mover.unpin(level, key)
        if copied is Copied.SOURCE_LOST:
            self.forget(key, level)
        if copied is not Copied.OK:
            return False
        self.added(key, 0)
        self.stats.promotions += 1
        return True

    def source(self, key: ChunkKey, promote: bool = True) -> int | None:
        """The tier to read ``key`` from now (promoting it into DRAM first when ``promote``);
        None if no tier holds it."""
        level = self.index.fastest(key)
        if level is None:
            return None
        if level == 0:
            if key in self._prefetched:
                self._prefetched.discard(key)
                self.stats.prefetch_hits += 1
        elif promote and self.promote(key, level):
            level = 0
        return level

    def promote_many(self, keys: Sequence[ChunkKey], level: int, fallback: bool = True,
                     pinned: bool = False) -> int:
        """Promote ``keys``, all held at ``level`` (their fastest copy), into DRAM in one batch;
        how many from the first were promoted. When DRAM cannot take them all at once: one
        :meth:`promote` after the other (``fallback``), or none. ``pinned``: the caller holds
        pins on ``keys`` at ``level`` (else they are pinned here, in one call)."""
        mover, n = self.mover, len(keys)
        pins = [] if pinned else [key for key, ok in zip(keys, mover.pin_many(level, keys), strict=True) if ok]
        try:
            whole = n > 1 and (pinned or len(pins) == n) and mover.fits(0, n)
            copied = mover.copy_many(keys, level, 0) if whole and self.make_room(0, n) else None
        finally:
            for key in pins:
                mover.unpin(level, key)
        if copied is None:
            if not fallback:
                return 0
            return next((i for i, key in enumerate(keys) if not self.promote(key, level)), n)
        done, leading = 0, True
        for key, c in zip(keys, copied, strict=True):
            if c is Copied.SOURCE_LOST:
                self.forget(key, level)
            if c is Copied.OK:
                self.added(key, 0)
                self.stats.promotions += 1
            leading = leading and c is Copied.OK
            done += leading
        return done

    def promote_prefix(self, keys: Sequence[ChunkKey], level: int | None = None, batch: int = 16) -> int:
        """Promote the held prefix of ``keys`` into DRAM, runs of consecutive chunks held in the
        same lower tier ``batch`` at a time (:meth:`promote_many`); stops at the first chunk held
        nowhere or not promoted. How many of ``keys`` from the first are in DRAM now.

        With ``level`` (a load about to read ``keys``): only runs whose fastest copy is in that
        tier, and only runs DRAM takes whole (the others are left where they are); the whole
        held prefix stays pinned where it is meanwhile, so that making room for one run never
        evicts another chunk of it. Returns how many were promoted."""
        if level is None:
            return self._promote_runs(keys, None, batch)
        index, mover = self.index, self.mover
        by_level: dict[int, list[ChunkKey]] = {}
        for key in keys:
            found = index.fastest(key)
            if found is None:
                break
            by_level.setdefault(found, []).append(key)
        pins = [(lvl, key) for lvl, ks in by_level.items()
                for key, ok in zip(ks, mover.pin_many(lvl, ks), strict=True) if ok]
        try:
            return self._promote_runs(keys[: sum(map(len, by_level.values()))], level, batch)
        finally:
            for lvl, key in pins:
                mover.unpin(lvl, key)

    def _promote_runs(self, keys: Sequence[ChunkKey], level: int | None, batch: int) -> int:
        index, n, promoted = self.index, 0, 0
        while n < len(keys):
            found = index.fastest(keys[n])
            if found is None:
                break
            if found == 0 or (level is not None and found != level):
                n += 1
                continue
            end = n + 1
            while end < len(keys) and end - n < batch and index.fastest(keys[end]) == found:
                end += 1
            run = keys[n:end]
            done = self.promote_many(run, found, fallback=level is None, pinned=level is not None)
            promoted += done
            if level is None and done < len(run):
                return n + done
            n = end
        return promoted if level is not None else n

    def prefetch(self, keys: Sequence[ChunkKey]) -> int:
        """Promote the held prefix of ``keys`` into DRAM (:meth:`promote_prefix`); stops at the
        first chunk held nowhere or that finds no room. Touches ``keys``; returns how many
        chunks were promoted."""
        index = self.index
        below = []
        for key in keys:
            level = index.fastest(key)
            if level is None:
                break
            below.append(level > 0)
        held = self.promote_prefix(keys[: len(below)])
        promoted = [key for key, lower in zip(keys[:held], below, strict=False) if lower]
        self._prefetched.update(promoted)
        self.stats.prefetched += len(promoted)
        self.touch(keys)
        return len(promoted)
