"""Where chunks live: the placement rules the live store and trace replay share.

Bookkeeping apart from byte movement (vLLM's offload manager and its transfer handlers):
:class:`Placement` owns the chunk index and one policy per tier and decides what is admitted,
evicted, demoted, promoted and dropped. Each decision is a plain :class:`Move` (a chunk, a
source tier, a destination tier) handed to a :class:`Mover`, which carries it out and reports
the outcome (:class:`Copied`); the placement records it. The live store's mover hands each move
to the transfer handler registered for its pair of tiers and releases the store's lock while the
bytes move (:mod:`kvtier.store.moves`); ``kvtier replay``'s mover only counts chunks against
capacities. The same object, the same policies, the same rules:

- ``lookup``: the longest held prefix; touches its keys (every tier's policy is touched, even for
  keys its tier does not hold);
- a new chunk goes to DRAM once the DRAM policy ``admit`` s it (``room_for_new``);
- making room in a tier evicts its policy's ``victim`` among the chunks the mover says may go
  (not pinned, not already leaving); an evicted chunk is demoted to the next tier (written there
  only if that tier does not hold it yet and its policy admits it; room is made there first,
  recursively), from the last tier it is dropped;
- ``source``: the tier to read a chunk from; a chunk found below DRAM is promoted into DRAM first
  (its lower copy stays, so demoting it again costs no write). The chunk is pinned in its tier
  while room is made, so the demotions that makes cannot evict it;
- ``prefetch``: promotes the held prefix of a queued request's chunks; ``promote_prefix`` (also
  used by the store's load) promotes runs of consecutive chunks held in the same lower tier
  in one batch (``Mover.copy_many``: one round trip to the remote tier, not one per chunk);
- scheduler hooks ``begin`` and ``hint`` reach every policy (see
  :mod:`kvtier.core.policies.base`); ``staging`` asks the DRAM policy what to prefetch ahead
  of any request (the caller prefetches it: at once in the replay, in the background live).

Concurrency: not thread-safe; the store calls it under its lock. A live mover may release that
lock while it moves bytes, so every decision is checked again when its move returns: a victim
marked *leaving* is skipped by other evictions while its demotion runs, and it is dropped after
it only if nobody pinned it meanwhile (then it stays, now with a copy below).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.index import ChunkIndex, PrefixHit
from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Copied, Move, Mover, Shape
from kvtier.core.policies.base import EvictionPolicy


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
        self._leaving: list[set[ChunkKey]] = [set() for _ in self.policies]

    @property
    def lookahead(self) -> int:
        """Queued requests the DRAM policy wants announced with :meth:`hint` (0: none)."""
        return self.policies[0].lookahead

    def leaving(self, key: ChunkKey, level: int) -> bool:
        """Whether ``key`` is being evicted from ``level`` (its demotion is running)."""
        return key in self._leaving[level]

    # -- scheduler hooks ----------------------------------------------------------------------
    def begin(self, seq: int, now: float) -> None:
        for policy in self.policies:
            policy.begin(seq, now)

    def hint(self, seq: int, keys: Sequence[ChunkKey], now: float | None = None) -> None:
        """Request ``seq`` is queued and will need ``keys``; ``now``: when it arrived."""
        for policy in self.policies:
            policy.hint(seq, keys)
            if now is not None:
                policy.arrived(seq, keys, now)

    def finished(self, seq: int, now: float) -> None:
        """Request ``seq``'s reply was done at ``now``."""
        for policy in self.policies:
            policy.finished(seq, now)

    def staging(self, now: float) -> list[Sequence[ChunkKey]]:
        """What the DRAM policy wants prefetched now, ahead of any request (after ``begin``);
        nothing without a lower tier to bring it from."""
        return self.policies[0].staging(now) if self.levels > 1 else []

    # -- bookkeeping --------------------------------------------------------------------------
    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        for policy in self.policies:
            policy.touch(keys, cost_s, start=start, use=use)

    def added(self, key: ChunkKey, level: int, position: int | None = None) -> None:
        """A chunk landed in tier ``level`` (a save committed, a copy finished, a tier reopened
        with it: then ``position``, its index in its sequence, if known)."""
        if not self.index.holds(key, level):
            self.index.add(key, level, position)
            self.policies[level].insert(key, position if position is not None else self.index.position(key))

    def forget(self, key: ChunkKey, level: int) -> None:
        """Tier ``level`` lost the chunk (damage found on read): it leaves the index."""
        if self.index.holds(key, level):
            self.index.discard(key, level)
            self.policies[level].remove(key)
            self.stats.lost += 1
        if level == 0:
            self._prefetched.discard(key)

    def lookup(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *,
               use: int | None = None) -> PrefixHit:
        hit = self.index.longest_prefix(keys)
        self.touch(hit.keys, cost_s, use=use)
        return hit

    # -- placement ----------------------------------------------------------------------------
    def admits(self, key: ChunkKey, position: int | None, remaining: int = 1) -> bool:
        """Whether the DRAM policy admits new chunk ``position`` of a sequence; ``remaining``:
        chunks of the sequence from this one on (all count as refused on False)."""
        if not self.policies[0].admit(key, position):
            self.stats.refused += remaining
            return False
        return True

    def room_for_new(self, key: ChunkKey, position: int | None, remaining: int = 1,
                     entry: Shape | None = None) -> bool:
        """Admission and room in DRAM for new chunk ``position`` of a sequence; ``remaining``:
        chunks of the sequence from this one on (all count as refused or dropped on False)."""
        if not self.admits(key, position, remaining):
            return False
        if not self.make_room(0, entry=entry):
            self.stats.dropped += remaining
            return False
        return True

    def make_room(self, level: int, count: int = 1, entry: Shape | None = None) -> bool:
        """Evict from tier ``level`` until it has room for ``count`` entries; False if everything
        left is pinned (or being moved by someone else)."""
        while not self.mover.has_room(level, count, entry):
            if not self.evict(level, entry):
                return False
        return True

    def evicting(self, level: int) -> int:
        """Chunks being evicted from ``level`` now (their demotions are running)."""
        return len(self._leaving[level])

    def evict(self, level: int, entry: Shape | None = None) -> bool:
        """Evict one victim from tier ``level`` (with its region, see
        :meth:`Mover.evict_group`), demoting it. False if none can go."""
        mover, leaving = self.mover, self._leaving[level]
        key = self.policies[level].victim(
            lambda k: k not in leaving and mover.evictable(level, k, entry))
        if key is None:
            return False
        group = mover.evict_group(level, key, entry)
        leaving.update(group)
        try:
            for k in group:
                self._evict_one(k, level)
        finally:
            leaving.difference_update(group)
            mover.group_done(level, group)
        return True

    def _evict_one(self, key: ChunkKey, level: int) -> None:
        if self.index.holds(key, level):
            self.demote(key, level)
        # The demotion may have let others run: drop the chunk only if it is still there and
        # nobody pinned it meanwhile (then it stays, now also held below).
        if not self.index.holds(key, level) or self.mover.is_pinned(level, key):
            return
        self.mover.drop(key, level)
        self.index.discard(key, level)
        self.policies[level].remove(key)
        self.stats.evictions[level] += 1
        if level == 0:
            self._prefetched.discard(key)

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
            if not self.make_room(lower, entry=self.mover.entry_of(level, key)):
                return False
            copied = self.mover.copy(Move(key, level, lower))
        finally:
            self.mover.unpin(level, key)
        return self._demoted(key, level, lower, copied)

    def _demoted(self, key: ChunkKey, level: int, lower: int, copied: Copied) -> bool:
        if copied is Copied.SOURCE_LOST:
            self.forget(key, level)
        if copied in (Copied.OK, Copied.QUEUED):
            self.stats.writes_down[lower] += 1
        if copied not in (Copied.OK, Copied.PRESENT):
            return False  # queued: the mover reports it with `added` once it is there
        self.added(key, lower)
        return True

    def promote(self, key: ChunkKey, level: int) -> bool:
        """Copy a chunk from ``level`` into DRAM. False if there is no room or the read fails."""
        mover = self.mover
        if not mover.pin(level, key):
            return False
        try:  # pinned: making room in DRAM demotes into lower tiers, which must not evict it
            if not self.make_room(0, entry=mover.entry_of(level, key)):
                return False
            copied = mover.copy(Move(key, level, 0))
        finally:
            mover.unpin(level, key)
        return self._promoted(key, level, copied)

    def _promoted(self, key: ChunkKey, level: int, copied: Copied) -> bool:
        if copied is Copied.SOURCE_LOST:
            self.forget(key, level)
        if copied is Copied.PRESENT:  # another thread's copy landed (and is indexed already)
            return self.index.holds(key, 0)
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
            entry = mover.entry_of(level, keys[0])
            whole = n > 1 and (pinned or len(pins) == n) and mover.fits(0, n, entry)
            copied = (mover.copy_many([Move(key, level, 0) for key in keys])
                      if whole and self.make_room(0, n, entry) else None)
        finally:
            for key in pins:
                mover.unpin(level, key)
        if copied is None:
            if not fallback:
                return 0
            return next((i for i, key in enumerate(keys) if not self.promote(key, level)), n)
        done, leading = 0, True
        for key, c in zip(keys, copied, strict=True):
            ok = self._promoted(key, level, c)
            leading = leading and ok
            done += leading
        return done

    def promote_prefix(self, keys: Sequence[ChunkKey], level: int | None = None, batch: int = 16,
                       deadline: float | None = None) -> int:
        """Promote the held prefix of ``keys`` into DRAM, runs of consecutive chunks held in the
        same lower tier ``batch`` at a time (:meth:`promote_many`); stops at the first chunk held
        nowhere or not promoted. How many of ``keys`` from the first are in DRAM now.

        With ``level`` (a load about to read ``keys``): only runs whose fastest copy is in that
        tier, and only runs DRAM takes whole (the others are left where they are); the whole
        held prefix stays pinned where it is meanwhile, so that making room for one run never
        evicts another chunk of it. Returns how many were promoted.

        ``deadline`` (``time.monotonic()``): no run is begun after it (a caller answering
        within a budget -- the daemon's acquire -- gets what came up by then)."""
        if level is None:
            return self._promote_runs(keys, None, batch, deadline)
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
            return self._promote_runs(keys[: sum(map(len, by_level.values()))], level, batch, deadline)
        finally:
            for lvl, key in pins:
                mover.unpin(lvl, key)

    def _promote_runs(self, keys: Sequence[ChunkKey], level: int | None, batch: int,
                      deadline: float | None = None) -> int:
        index, n, promoted = self.index, 0, 0
        while n < len(keys):
            if deadline is not None and time.monotonic() > deadline:
                break
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

    def prefetch(self, keys: Sequence[ChunkKey], *, start: int = 0, use: int | None = None,
                 limit: int | None = None) -> int:
        """Promote the held prefix of ``keys`` into DRAM (:meth:`promote_prefix`); stops at the
        first chunk held nowhere or that finds no room, and with ``limit`` after that many of
        ``keys`` (what the caller has the time or the room for; 0: none). Touches all of
        ``keys`` (the policies see the request's whole sequence); returns how many chunks were
        promoted."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be None or >= 0, got {limit!r}")
        index = self.index
        below = []
        for key in keys[:limit]:
            level = index.fastest(key)
            if level is None:
                break
            below.append(level > 0)
        held = self.promote_prefix(keys[: len(below)])
        promoted = [key for key, lower in zip(keys[:held], below, strict=False) if lower]
        self._prefetched.update(promoted)
        self.stats.prefetched += len(promoted)
        self.touch(keys, start=start, use=use)
        return len(promoted)
