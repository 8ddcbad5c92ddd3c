"""The contract between a store (or the replay simulator) and a placement policy.

A store keeps one policy instance per tier. The policy only orders keys; it never touches a tier
(the store asks it for candidates, skips the ones that are pinned, and moves the bytes).

Call order, per tier:

- ``insert`` when a chunk lands in the tier (``position``: its index in its sequence, when
  known), ``remove`` when it leaves (evicted or lost). The store touches every chunk it inserts
  right after (a save touches its sequence; a chunk recovered from SSD is touched alone at its
  recorded position), so a policy may hold an inserted chunk back from eviction until then;
- ``touch`` when a sequence's chunks are looked up, loaded, saved or prefetched: ``keys[i]`` is
  chunk ``start + i`` of the sequence (a run of consecutive chunks, usually from the first), so
  ``start + i`` is its position; every tier's policy is touched, including for keys the tier does
  not hold. ``use`` names the request the touch belongs to (its number, as in ``begin``): the
  touches of one request (lookup, load, save) are one use of a chunk, whatever else happens in
  between. Without it, a touch belongs to the request last begun, or, with no scheduler at all,
  is a use of its own;
- ``victim`` names the key to evict next among those the store says it may evict (not pinned);
- ``admit`` is asked before a chunk is written into the tier (saved into DRAM, demoted to SSD);
  a refused chunk is not written there (a save stops at the first refusal, since a chunk without
  its prefix can never hit).

Optional scheduler hooks (defaults do nothing), for policies that look at the request queue:

- ``begin(seq, now)`` when request number ``seq`` (0, 1, ... in service order) starts being
  served at ``now`` seconds; it comes before that request's lookup;
- ``hint(seq, keys)`` when request ``seq``, arrived but not yet served, is known to need ``keys``
  (prefix order). Only policies with ``lookahead > 0`` get hints: the scheduler announces up to
  ``lookahead`` queued requests, and also prefetches their chunks into DRAM;
- ``arrived(seq, keys, now)`` right after a hint, when the scheduler knows when the request arrived
  (the live store, and the replay in a closed loop), and ``finished(seq, now)`` when a
  request's reply is done (the live store's ``finished``; the replay in a closed loop): a
  conversation's next turn arrives a think time after the reply to its last one. An engine may
  still save the finished request's last chunks (vLLM's connector does): those touches carry
  its ``use`` all the same;
- ``staging(now)``, asked of the DRAM tier's policy at each ``begin`` (with its ``now``), only
  when there is a lower tier to bring chunks from: the sequences (prefix order) it wants in
  DRAM now, ahead of any request for them (a conversation predicted to come back soon). The
  store prefetches each as it prefetches a queued request's chunks, in the background (the
  replay after the begun request's own lookup and saves, as a background prefetch would land);
  that prefetch touches exactly those keys with no ``use`` of its own, so its touch belongs to
  the request last begun, which does not use them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.core.cost_model import ComputeModel
from kvtier.core.keys import ChunkKey

FutureUses = Mapping[ChunkKey, Sequence[int]]
"""For each key, the ascending request numbers (service order) that will use it. Offline only."""


@dataclass(frozen=True)
class TierContext:
    """What a policy instance may know about its tier and the model served."""

    level: int = 0
    """0 is the fastest tier (DRAM), 1 the next (SSD)."""
    chunk_load_s: float = 0.0
    """Seconds to read one chunk from this tier."""
    chunk_tokens: int = 512
    compute: ComputeModel = field(default_factory=ComputeModel)
    future: FutureUses | None = None
    """The whole future of a trace; only the offline ``optimal`` bound takes it."""
    costs_known: bool = True
    """Whether ``compute`` and ``chunk_load_s`` are the served model's and the tier's. A live
    store serves any model on any machine (its compute model is a nominal 8B model on an
    accelerator, its chunk a nominal size): the difference of two such guesses decides
    nothing, so there a hit saves its chunk's nominal recompute, whatever tier it is in."""

    def __post_init__(self) -> None:
        if not isinstance(self.level, int) or self.level < 0:
            raise ValueError(f"TierContext.level must be a non-negative int, got {self.level!r}")
        if not self.chunk_load_s >= 0:
            raise ValueError(f"TierContext.chunk_load_s must be >= 0, got {self.chunk_load_s!r}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens <= 0:
            raise ValueError(f"TierContext.chunk_tokens must be a positive int, got {self.chunk_tokens!r}")

    def miss_saving_s(self, position: int) -> float:
        """Prefill time a hit on chunk ``position`` in this tier saves (:meth:`hit_saving_s` of
        its recompute)."""
        return self.hit_saving_s(self.compute.chunk_recompute_s(position, self.chunk_tokens))

    def hit_saving_s(self, miss_s: float) -> float:
        """What a hit in this tier saves of a miss that costs ``miss_s``: that less the tier's
        read, never negative; ``miss_s`` itself where the costs are nominal (:attr:`costs_known`)."""
        if not self.costs_known:
            return miss_s
        return max(miss_s - self.chunk_load_s, 0.0)


class EvictionPolicy(ABC):
    """Orders the chunks of one tier for eviction (see the module docstring for call order)."""

    lookahead: int = 0
    """Queued requests this policy wants announced through :meth:`hint` (0: none)."""

    @abstractmethod
    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        """``key`` landed in the tier; ``position``: its index in its sequence, when known."""

    @abstractmethod
    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        """``keys`` are chunks ``start, start + 1, ...`` of one sequence, just used.
        ``cost_s``: seconds a miss on each of them costs, when the caller knows (the parts of a
        typed object declare their object's rebuild time); None for KV chunks, whose cost is
        the tier context's compute model at their position. ``use``: the request number the
        touch belongs to (see the module docstring)."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        """The key to evict next among those for which ``evictable`` is true; None if none."""

    @abstractmethod
    def __len__(self) -> int: ...

    def admit(self, key: ChunkKey, position: int | None) -> bool:
        """Whether chunk ``position`` of a sequence (None: not known, as on demotion) may be
        written into this tier."""
        return True

    def begin(self, seq: int, now: float) -> None:
        """Request ``seq`` starts being served at ``now`` seconds."""

    def hint(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        """Request ``seq``, queued, will need ``keys``; it leaves the queue at ``begin(seq)``."""

    def arrived(self, seq: int, keys: Sequence[ChunkKey], now: float) -> None:
        """Request ``seq`` (just announced with :meth:`hint`, needing ``keys``) arrived at
        ``now`` seconds (on the clock of ``begin``)."""

    def finished(self, seq: int, now: float) -> None:
        """Request ``seq``'s reply was done at ``now`` seconds: its user reads it, and a
        conversation's next turn comes a think time after this."""

    def staging(self, now: float) -> list[Sequence[ChunkKey]]:
        """Sequences to prefetch into DRAM now (prefix order), ahead of any request for them;
        asked of the DRAM tier's policy after each ``begin``. Default: none."""
        return []
