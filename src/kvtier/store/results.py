"""What the store's calls return (:class:`LookupResult`, :class:`LoadResult`, :class:`SaveResult`),
its counters (:class:`StoreStats`), and what an engine needs of a KV cache (:class:`KVCacheAPI`).

Kept apart from the configuration (:mod:`kvtier.store.config`), which knows the tiers: a store
daemon's client returns these types without depending on any tier class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.store.packing import LayerKV


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest cached prefix of a token sequence."""

    num_tokens: int
    hit_tokens: int
    keys: list[ChunkKey]
    tiers: list[str]
    """Name of the fastest tier holding each hit chunk."""

    @property
    def tier_tokens(self) -> dict[str, int]:
        chunk = self.hit_tokens // len(self.keys) if self.keys else 0
        return {name: n * chunk for name, n in Counter(self.tiers).items()}


@dataclass(frozen=True, slots=True)
class LoadResult:
    """KV for the first ``tokens`` tokens (may be fewer than the lookup promised)."""

    tokens: int
    kv: list[LayerKV]
    tiers: list[str]
    """Tier each loaded chunk was read from."""


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What a save did with each full chunk it was given: every one is counted once, in
    ``stored``, ``present``, ``dropped`` or ``busy``; ``unpersisted`` is a part of ``stored``."""

    stored: int
    """New chunks this save wrote and committed into DRAM (readable there when committed; with
    ``write_through``, see ``unpersisted`` for which of them reached SSD)."""
    present: int
    """Chunks already held (by this or any earlier sequence: stored once)."""
    dropped: int
    """Chunks not written: no DRAM slot (every resident chunk pinned, or the policy did not
    admit the chunk), and every chunk after the first such one (a later chunk without it could
    never hit)."""
    busy: int = 0
    """Chunks another writer was writing at the same moment (skipped: they will be there)."""
    unpersisted: int = 0
    """With ``write_through``: of ``stored``, the chunks not on SSD when their copy there ended
    (SSD's policy refused them, the SSD write failed or found no room, or DRAM dropped them
    first because SSD could not take them): in DRAM at most, gone after a restart. The save
    waits for every copy, so each of the other ``stored - unpersisted`` was on SSD before it
    returned; SSD may evict one later to make room, as any SSD chunk (even for a later chunk
    of the same save, when SSD holds fewer chunks than a save writes). Always 0 without
    write-through."""


@dataclass(slots=True)
class StoreStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    """Tokens lookups found cached (offered; engines may already have had some of them)."""
    hits: Counter[str] = field(default_factory=Counter)
    """Per tier: looked-up chunks whose fastest copy was in that tier."""
    misses: Counter[str] = field(default_factory=Counter)
    """Per tier: looked-up full chunks that tier did not serve (found lower, or nowhere)."""
    loaded_tokens: Counter[str] = field(default_factory=Counter)
    """Per tier: tokens engines took from kvtier (an in-process load's tokens; what a daemon
    client reports it copied into its engine), by the tier each chunk was found in."""
    loaded_chunks: Counter[str] = field(default_factory=Counter)
    """Per tier: chunks handed out (read, or pinned for a client to read), by where found."""
    had_tokens: int = 0
    """Tokens engines already held themselves (their own prefix cache) when they asked."""
    saved_chunks: int = 0
    dedup_chunks: int = 0
    busy_chunks: int = 0
    """Chunks not written because another writer was writing them at that moment."""
    dropped_chunks: int = 0
    load_failures: int = 0
    """Chunks the index promised that no tier could read (damaged or lost)."""
    engine_load_failures: int = 0
    """Chunks engines reported they could not load (a lease lost mid-copy, a copy that
    raised): recomputed by the engine."""
    prefetches_dropped: int = 0
    """Background prefetch hints dropped because too many were already waiting."""


class KVCacheAPI(Protocol):
    """What an engine needs of a KV cache: a :class:`~kvtier.store.KVStore` in its process, or a
    :class:`~kvtier.server.client.StoreClient` of a store daemon shared with other processes.
    Both return the same result types; ``request`` names the request a call belongs to (call
    ``started`` first) so the policies count one use per request."""

    layout: KVLayout
    tier_names: list[str]

    def keys_for(self, tokens: object) -> list[ChunkKey]: ...

    def lookup(self, tokens: object, *, request: str | None = None) -> LookupResult: ...

    def load(self, hit: LookupResult, out: Sequence[LayerKV], *, layers: Sequence[int] | None = None,
             promote: bool = True, request: str | None = None) -> LoadResult: ...

    def save(self, tokens: object, kv: Sequence[Sequence[object]], *,
             request: str | None = None) -> SaveResult: ...

    def prefetch(self, keys: Sequence[ChunkKey], wait: bool = ...) -> int: ...

    def started(self, request_id: str) -> None: ...

    def finished(self, request_id: str) -> None: ...

    def close(self) -> None: ...
