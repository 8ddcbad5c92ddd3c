"""The store's configuration and result types (kept apart from :mod:`kvtier.store.facade`'s logic).

``StoreConfig`` is the store's whole configuration; ``RemoteConfig`` adds the shared tier below
SSD. Lookups, loads and saves return the frozen result types below.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.placement import Shape
from kvtier.core.policy import LIVE_POLICIES, POLICIES
from kvtier.store.packing import LayerKV
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTierConfig
from kvtier.tiers.host import HostTierConfig

NOMINAL_CHUNK_BYTES = 16 << 20
"""What the policies assume a chunk weighs when the store serves any model."""
NOMINAL_READ_BPS = {"host": 10e9, "disk": 1.5e9, "remote": 1e9}
"""Read bandwidth per kind of tier that cost-aware policies assume; the order of magnitude
`kvtier bench io` and `kvtier bench remote` measure on the development machines."""
WRITE_MODES = ("through", "back")


@dataclass(frozen=True)
class RemoteConfig:
    """The shared remote tier below SSD (or below DRAM when there is no SSD)."""

    tier: object
    """A :class:`~kvtier.tiers.valkey.ValkeyTierConfig` or a
    :class:`~kvtier.tiers.mooncake.MooncakeTierConfig`."""
    write: str = "through"
    """``through``: every saved chunk is uploaded (in the background) as soon as it is saved,
    so other instances find it at once. ``back``: a chunk is uploaded only when it leaves the
    last local tier (fewer remote writes; other instances see it later)."""
    max_queued: int = 256
    """Chunks waiting for upload at most; beyond that a chunk is not uploaded (counted)."""
    verify_s: float = 5.0
    """A chunk a lookup found in the remote tier is trusted this long before one asks again."""
    miss_s: float = 1.0
    """A chunk the remote tier did not have is not asked for again for this long."""

    def __post_init__(self) -> None:
        kind = type(self.tier).__name__
        if kind not in ("ValkeyTierConfig", "MooncakeTierConfig"):
            raise TypeError(f"RemoteConfig.tier must be a ValkeyTierConfig or MooncakeTierConfig, got {kind}")
        if self.write not in WRITE_MODES:
            raise ValueError(f"RemoteConfig.write must be one of {WRITE_MODES}, got {self.write!r}")
        if not isinstance(self.max_queued, int) or self.max_queued <= 0:
            raise ValueError(f"RemoteConfig.max_queued must be a positive int, got {self.max_queued!r}")
        for name in ("verify_s", "miss_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"RemoteConfig.{name} must be a number of seconds >= 0, got {value!r}")


def make_remote_tier(config: object) -> Tier:
    """The remote tier for a backend config (imports the backend's client only when used)."""
    kind = type(config).__name__
    if kind == "ValkeyTierConfig":
        from kvtier.tiers.valkey import ValkeyTier

        return ValkeyTier(config)  # type: ignore[arg-type]
    if kind == "MooncakeTierConfig":
        from kvtier.tiers.mooncake import MooncakeTier

        return MooncakeTier(config)  # type: ignore[arg-type]
    raise TypeError(f"no remote tier for a {kind}")


class Slot(enum.Enum):
    """Why :meth:`ChunkCache.reserve` returned no reservation."""

    HELD = "held"
    """Some tier already holds the entry: nothing to write."""
    BUSY = "busy"
    """Someone else is writing the entry right now: skip it (it will be there)."""


class EntryState(enum.Enum):
    """Where an entry stands in one tier (:meth:`ChunkCache.states`)."""

    WRITING = "writing"
    """Reserved and being filled: invisible to lookups; a second writer of the key skips it."""
    READABLE = "readable"
    """Committed and indexed."""
    READING = "reading"
    """Readable and pinned by a reader: it cannot be deleted or its slot reused."""
    EVICTING = "evicting"
    """Chosen as a victim, its copy to the tier below running: still readable, skipped by other
    evictions, dropped after its demotion only if nobody pinned it meanwhile."""


@dataclass(frozen=True)
class CacheConfig:
    host: HostTierConfig
    disk: DiskTierConfig | None = None
    remote: RemoteConfig | None = None
    policy: str = "lru"
    write_through: bool = False
    """Also write every committed entry to SSD (in the background), so it survives a restart."""
    chunk: Shape | None = None
    """The one entry shape of a store of one model (DRAM slots of that size). None: any
    shapes (a daemon serving any model: DRAM is shared by sizes an extent at a time)."""
    chunk_tokens: int = 256
    """Tokens per chunk, for the policies' cost model."""
    room_wait_s: float = 2.0
    """How long ``reserve`` waits for evictions other threads are running to free a slot."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, HostTierConfig):
            raise TypeError("CacheConfig.host must be a HostTierConfig")
        if self.disk is not None and not isinstance(self.disk, DiskTierConfig):
            raise TypeError("CacheConfig.disk must be a DiskTierConfig")
        if self.remote is not None and not isinstance(self.remote, RemoteConfig):
            raise TypeError("CacheConfig.remote must be a RemoteConfig")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known policies: {sorted(POLICIES)}")
        if self.policy not in LIVE_POLICIES:
            raise ValueError(
                f"policy {self.policy!r} is an offline bound for `kvtier replay`, not a live policy; "
                f"live policies: {list(LIVE_POLICIES)}"
            )
        if not isinstance(self.write_through, bool):
            raise ValueError(f"write_through must be true or false, got {self.write_through!r}")
        if isinstance(self.room_wait_s, bool) or not isinstance(self.room_wait_s, (int, float)) or self.room_wait_s < 0:
            raise ValueError(f"room_wait_s must be a number of seconds >= 0, got {self.room_wait_s!r}")


@dataclass(frozen=True, slots=True)
class Held:
    """One entry pinned in DRAM by :meth:`ChunkCache.acquire`."""

    key: ChunkKey
    offset: int
    """Byte offset of its slot in the DRAM arena."""
    nbytes: int
    source: str
    """The tier it was found in (``host``, or ``disk``/``remote`` if it was promoted)."""


MAX_WAITING = 65536
"""Queued requests remembered between :meth:`KVStore.queued` and :meth:`KVStore.started`."""


@dataclass(frozen=True)
class StoreConfig:
    model: str
    """The model's id, part of every key: anything that changes its KV must change it --
    :func:`kvtier.model_id.model_fingerprint` of its directory (config files and every byte of
    its weights), plus whatever the engine decides on top (see
    :mod:`kvtier.engines.vllm.namespace`)."""
    layout: KVLayout
    host: HostTierConfig
    disk: DiskTierConfig | None = None
    policy: str = "lru"
    tenant: str = ""
    """Default tenant salt; chunks are shared only between callers with the same salt."""
    write_through: bool = False
    """Also write every saved chunk to SSD at once (so it survives a restart), instead of
    only when DRAM demotes it. Costs SSD write bandwidth on every save."""
    remote: RemoteConfig | None = None

    def cache_config(self) -> CacheConfig:
        """The configuration of the store's :class:`~kvtier.store.cache.ChunkCache`."""
        return CacheConfig(host=self.host, disk=self.disk, remote=self.remote, policy=self.policy,
                           write_through=self.write_through,
                           chunk=Shape(self.layout.chunk_bytes, self.layout.layer_bytes),
                           chunk_tokens=self.layout.chunk_tokens)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("StoreConfig.model must be a non-empty string")
        if not isinstance(self.layout, KVLayout):
            raise TypeError("StoreConfig.layout must be a KVLayout")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known policies: {sorted(POLICIES)}")
        if self.remote is not None and not isinstance(self.remote, RemoteConfig):
            raise TypeError("StoreConfig.remote must be a RemoteConfig")
        if self.policy not in LIVE_POLICIES:
            raise ValueError(
                f"policy {self.policy!r} is an offline bound for `kvtier replay`, not a live policy; "
                f"live policies: {list(LIVE_POLICIES)}"
            )


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
