"""The store's configuration (kept apart from :mod:`kvtier.store.facade`'s logic).

``StoreConfig`` is the store's whole configuration; ``RemoteConfig`` adds the shared tier below
SSD. Lookups, loads and saves return the frozen types of :mod:`kvtier.store.results`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.mover import Shape
from kvtier.core.policy import LIVE_POLICIES, POLICIES
from kvtier.tiers.base import Tier
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.host_config import HostTierConfig

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
    hint_share: float = 0.5
    """The share of the local capacity (DRAM + SSD) one tenant's retained sessions may hold
    (session hints' ``retain_s``; all tenants together at most 0.9 of it). 0: no retention."""

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
        if isinstance(self.hint_share, bool) or not isinstance(self.hint_share, (int, float)) \
                or not 0 <= self.hint_share <= 1:
            raise ValueError(f"hint_share must be a number from 0 to 1, got {self.hint_share!r}")


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
