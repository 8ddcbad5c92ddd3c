"""Two-tier placement without bytes: the store's placement rules over a :class:`ChunkIndex`.

:class:`Placement` is what :class:`kvtier.store.KVStore` does with its index and policies,
minus the byte movement, with tier capacity counted in chunks. Trace replay uses it to measure
policies; it drives the policies exactly as the store does:

- ``lookup``: the longest held prefix; touches its keys (every tier's policy);
- ``load``: reads the hit's chunks in order, promoting a chunk found on SSD into DRAM (its SSD
  copy stays); touches the chunks read;
- ``save``: new chunks go to DRAM, after the DRAM policy ``admit`` s them; touches all keys;
- ``prefetch``: promotes the held prefix of a queued request's keys; touches them;
- making room evicts the tier policy's ``victim``: from DRAM it is demoted to SSD (written only if
  SSD does not hold it yet and the SSD policy admits it), from SSD it is dropped. The chunk being
  promoted is pinned in its tier while room is made for it (as the store pins it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.index import ChunkIndex, PrefixHit
from kvtier.core.keys import ChunkKey
from kvtier.core.policies.base import EvictionPolicy, TierContext
from kvtier.core.policy import POLICIES, make_policy


@dataclass(frozen=True)
class PlacementConfig:
    policy: str = "lru"
    dram_chunks: int = 1024
    ssd_chunks: int = 0
    """0: no SSD tier (DRAM evictions are dropped)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known policies: {list(POLICIES)}")
        if not isinstance(self.dram_chunks, int) or self.dram_chunks <= 0:
            raise ValueError(f"dram_chunks must be a positive int, got {self.dram_chunks!r}")
        if not isinstance(self.ssd_chunks, int) or self.ssd_chunks < 0:
            raise ValueError(f"ssd_chunks must be a non-negative int, got {self.ssd_chunks!r}")

    @property
    def capacities(self) -> tuple[int, ...]:
        return (self.dram_chunks, self.ssd_chunks) if self.ssd_chunks else (self.dram_chunks,)


@dataclass(slots=True)
class PlacementStats:
    hits: list[int] = field(default_factory=lambda: [0, 0])
    """Per level: chunks loaded whose fastest copy was in that tier."""
    promotions: int = 0
    demotions: int = 0
    """Chunks written to SSD."""
    ssd_reads: int = 0
    """Chunks read from SSD (promotions, prefetches, and loads that could not promote)."""
    evictions: list[int] = field(default_factory=lambda: [0, 0])
    refused: int = 0
    """Chunks a policy did not admit: into DRAM (counted with the rest of their sequence), or
    into SSD on demotion (dropped instead)."""
    dropped: int = 0
    """Chunks that found no room (everything pinned)."""
    prefetched: int = 0
    prefetch_hits: int = 0
    """Prefetched chunks later found in DRAM by a lookup (each counted once)."""


class Placement:
    """Index plus one policy per tier; capacities in chunks. Not thread-safe."""

    def __init__(self, config: PlacementConfig, contexts: Sequence[TierContext] | None = None) -> None:
        caps = config.capacities
        if contexts is None:
            contexts = [TierContext(level=lvl) for lvl in range(len(caps))]
        if len(contexts) != len(caps):
            raise ValueError(f"{len(caps)} tiers but {len(contexts)} tier contexts")
        self.config = config
        self.capacity = caps
        self.index = ChunkIndex()
        self.policies: list[EvictionPolicy] = [make_policy(config.policy, c) for c in contexts]
        self.used = [0] * len(caps)
        self.stats = PlacementStats()
        self._prefetched: set[ChunkKey] = set()
        self._pinned: tuple[ChunkKey, int] | None = None

    @property
    def lookahead(self) -> int:
        return self.policies[0].lookahead

    # -- scheduler hooks ----------------------------------------------------------------------
    def begin(self, seq: int, now: float) -> None:
        for policy in self.policies:
            policy.begin(seq, now)

    def hint(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        for policy in self.policies:
            policy.hint(seq, keys)

    # -- the store's calls --------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> PrefixHit:
        hit = self.index.longest_prefix(keys)
        self._touch(hit.keys)
        return hit

    def load(self, hit: PrefixHit) -> list[int]:
        """Read ``hit``'s chunks in order; the level each was read from (before promotion).
        Stops early if making room for a promotion dropped a later chunk of the hit."""
        index, sources = self.index, []
        for key in hit.keys:
            level = index.fastest(key)
            if level is None:
                break
            if level == 0:
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    self.stats.prefetch_hits += 1
            else:
                if not self._promote(key, level):
                    self.stats.ssd_reads += 1  # read in place
            self.stats.hits[level] += 1
            sources.append(level)
        self._touch(hit.keys[: len(sources)])
        return sources

    def save(self, keys: Sequence[ChunkKey]) -> int:
        """Add the chunks of ``keys`` not held yet to DRAM; how many were added."""
        stored = 0
        index, dram = self.index, self.policies[0]
        for i, key in enumerate(keys):
            if key in index:
                continue
            if not dram.admit(key, i):
                self.stats.refused += len(keys) - i
                break
            if not self._make_room(0):
                self.stats.dropped += len(keys) - i
                break
            self._add(key, 0)
            stored += 1
        self._touch(keys)
        return stored

    def prefetch(self, keys: Sequence[ChunkKey]) -> int:
        """Promote the held prefix of ``keys`` into DRAM; stops at the first chunk held nowhere."""
        promoted = 0
        index = self.index
        for key in keys:
            level = index.fastest(key)
            if level is None:
                break
            if level > 0:
                if not self._promote(key, level):
                    break
                promoted += 1
                self._prefetched.add(key)
        self.stats.prefetched += promoted
        self._touch(keys)
        return promoted

    # -- placement ----------------------------------------------------------------------------
    def _touch(self, keys: Sequence[ChunkKey]) -> None:
        for policy in self.policies:
            policy.touch(keys)

    def _add(self, key: ChunkKey, level: int) -> None:
        self.index.add(key, level)
        self.policies[level].insert(key)
        self.used[level] += 1

    def _make_room(self, level: int) -> bool:
        while self.used[level] >= self.capacity[level]:
            if not self._evict(level):
                return False
        return True

    def _evict(self, level: int) -> bool:
        pinned = self._pinned
        if pinned is not None and pinned[1] == level:
            held = pinned[0]
            key = self.policies[level].victim(lambda k: k != held)
        else:
            key = self.policies[level].victim(lambda k: True)
        if key is None:
            return False
        lower = level + 1
        if lower < len(self.capacity) and not self.index.holds(key, lower):
            if not self.policies[lower].admit(key, None):
                self.stats.refused += 1
            elif self._make_room(lower):
                self._add(key, lower)
                self.stats.demotions += 1
        self.index.discard(key, level)
        self.policies[level].remove(key)
        self.used[level] -= 1
        self.stats.evictions[level] += 1
        if level == 0:
            self._prefetched.discard(key)
        return True

    def _promote(self, key: ChunkKey, level: int) -> bool:
        self._pinned = (key, level)
        try:
            if not self._make_room(0):
                return False
        finally:
            self._pinned = None
        self._add(key, 0)
        self.stats.promotions += 1
        self.stats.ssd_reads += 1
        return True
