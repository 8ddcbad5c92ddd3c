"""The store without bytes: :class:`~kvtier.core.placement.Placement` over chunk counters.

Trace replay measures policies with this. The placement rules (admission, eviction, demotion,
promotion, prefetch) are the live store's own :class:`~kvtier.core.placement.Placement`; only
the mover differs: :class:`ChunkCounter` counts chunks against capacities instead of copying.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.index import PrefixHit
from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Copied, Move, Shape
from kvtier.core.placement import Placement
from kvtier.core.policies.base import TierContext
from kvtier.core.policy import POLICIES, make_policy


@dataclass(frozen=True)
class SimConfig:
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


@dataclass
class ChunkCounter:
    """A :class:`~kvtier.core.placement.Mover` that counts: capacity and use in chunks."""

    capacity: tuple[int, ...]
    used: list[int] = field(default_factory=list)
    reads: list[int] = field(default_factory=list)
    """Per level: chunks read from it (copies out of it)."""
    _pins: Counter[tuple[int, ChunkKey]] = field(default_factory=Counter)
    _held: list[set[ChunkKey]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.used = [0] * len(self.capacity)
        self.reads = [0] * len(self.capacity)
        self._held = [set() for _ in self.capacity]

    def has_room(self, level: int, count: int = 1, entry: Shape | None = None) -> bool:
        return self.used[level] + count <= self.capacity[level]

    def fits(self, level: int, count: int, entry: Shape | None = None) -> bool:
        return count <= self.capacity[level]

    def entry_of(self, level: int, key: ChunkKey) -> Shape | None:
        return None  # every chunk is one block

    def evictable(self, level: int, key: ChunkKey, entry: Shape | None = None) -> bool:
        return not self.is_pinned(level, key)

    def evict_group(self, level: int, key: ChunkKey, entry: Shape | None = None) -> list[ChunkKey]:
        return [key]

    def group_done(self, level: int, group: Sequence[ChunkKey]) -> None:
        pass

    def is_pinned(self, level: int, key: ChunkKey) -> bool:
        return self._pins[(level, key)] > 0

    def pin(self, level: int, key: ChunkKey) -> bool:
        if key not in self._held[level]:
            return False
        self._pins[(level, key)] += 1
        return True

    def pin_many(self, level: int, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.pin(level, key) for key in keys]

    def unpin(self, level: int, key: ChunkKey) -> None:
        self._pins[(level, key)] -= 1
        if not self._pins[(level, key)]:
            del self._pins[(level, key)]

    def write(self, key: ChunkKey, level: int) -> None:
        self._held[level].add(key)
        self.used[level] += 1

    def copy(self, move: Move) -> Copied:
        self.reads[move.src] += 1
        self.write(move.key, move.dst)
        return Copied.OK

    def copy_many(self, moves: Sequence[Move]) -> list[Copied]:
        return [self.copy(move) for move in moves]

    def drop(self, key: ChunkKey, level: int) -> None:
        self._held[level].discard(key)
        self.used[level] -= 1


class SimStore:
    """What the store does with a request's chunks, counted. Not thread-safe."""

    def __init__(self, config: SimConfig, contexts: Sequence[TierContext] | None = None) -> None:
        caps = config.capacities
        if contexts is None:
            contexts = [TierContext(level=lvl) for lvl in range(len(caps))]
        if len(contexts) != len(caps):
            raise ValueError(f"{len(caps)} tiers but {len(contexts)} tier contexts")
        self.config = config
        self.mover = ChunkCounter(caps)
        self.placement = Placement([make_policy(config.policy, c) for c in contexts], self.mover)
        self.hits = [0] * len(caps)
        """Per level: chunks loaded whose fastest copy was in that tier."""

    # the placement's scheduler hooks and calls, as the store exposes them
    @property
    def lookahead(self) -> int:
        return self.placement.lookahead

    def begin(self, seq: int, now: float) -> None:
        self.placement.begin(seq, now)

    def hint(self, seq: int, keys: Sequence[ChunkKey], now: float | None = None) -> None:
        self.placement.hint(seq, keys, now)

    def finished(self, seq: int, now: float) -> None:
        self.placement.finished(seq, now)

    def staging(self, now: float) -> list[Sequence[ChunkKey]]:
        return self.placement.staging(now)

    def prefetch(self, keys: Sequence[ChunkKey], *, limit: int | None = None) -> int:
        return self.placement.prefetch(keys, limit=limit)

    def lookup(self, keys: Sequence[ChunkKey], cost_s: float | None = None) -> PrefixHit:
        return self.placement.lookup(keys, cost_s)

    def load(self, hit: PrefixHit, cost_s: float | None = None) -> list[int]:
        """Read ``hit``'s chunks in order, promoting as the store does; the level each was read
        from. Stops early if making room for a promotion dropped a later chunk of the hit."""
        place, sources = self.placement, []
        for key in hit.keys:
            fastest = place.index.fastest(key)
            if fastest is None:
                break
            level = place.source(key)
            if level > 0:
                self.mover.reads[level] += 1  # read in place: DRAM had no room for it
            self.hits[fastest] += 1
            sources.append(fastest)
        place.touch(hit.keys[: len(sources)], cost_s)
        return sources

    def save(self, keys: Sequence[ChunkKey], cost_s: float | None = None) -> int:
        """Add the chunks of ``keys`` not held yet to DRAM; how many were added. ``cost_s``:
        what a miss on each costs, for parts of typed objects (None: KV chunks)."""
        place, stored = self.placement, 0
        for i, key in enumerate(keys):
            if key in place.index:
                continue
            if not place.room_for_new(key, i, remaining=len(keys) - i):
                break
            self.mover.write(key, 0)
            place.added(key, 0, position=i)
            stored += 1
        place.touch(keys, cost_s)
        return stored
