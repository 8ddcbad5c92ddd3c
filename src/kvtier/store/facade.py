"""KVStore: the facade an engine talks to.

    store = KVStore(StoreConfig(model="llama-3-8b@abc", layout=layout,
                                host=HostTierConfig(8 << 30), disk=DiskTierConfig("/ssd/kv", 200 << 30)))
    hit = store.lookup(tokens)                 # how many tokens are cached, and where
    loaded = store.load(hit)                   # per-layer (K, V) for the first loaded.tokens tokens
    store.save(tokens, kv)                     # new full chunks go to DRAM

One model's KV (its :class:`~kvtier.core.layout.KVLayout`) over a
:class:`~kvtier.store.cache.ChunkCache`, which holds the tiers (host DRAM, then SSD, then a shared
remote tier), decides placement (a :class:`~kvtier.core.placement.Placement`, the same object
``kvtier replay`` measures) and moves the bytes on its transfer handlers. A chunk saved goes to
DRAM; when DRAM is full the policy's victim is demoted to SSD (written there unless SSD already
holds it) rather than dropped; when SSD is full its victim is dropped. A chunk loaded from SSD
is promoted to DRAM (keeping its SSD copy). Everything read is pinned in its tier for the
duration of the copy.

Failure contract: a chunk that cannot be read (missing file, checksum mismatch) ends the prefix
at that chunk: ``load`` returns fewer tokens than ``lookup`` promised, never wrong bytes, and the
damage is counted in the tier's stats. Bad arguments raise before anything is changed.

Thread-safety: calls may come from any thread; the cache's lock is held for bookkeeping only,
never while bytes move, so one caller's SSD read does not stall another's lookup.

Requests: ``started(request_id)`` when an engine begins serving a request, and the same
``request=`` on its ``lookup``/``load``/``save``, make those one use of each chunk for the
policies (``queued`` when it arrives, for the look-ahead policies and a prefetch).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Self

import torch

from kvtier.core.index import ChunkIndex
from kvtier.core.keys import ChunkKey, Namespace, bind_keys, chunk_tokens_of
from kvtier.core.mover import Shape
from kvtier.core.placement import Placement
from kvtier.store.cache import ChunkCache, Held, Slot
from kvtier.store.cache_writes import wait_all
from kvtier.store.config import (
    RemoteConfig,
    StoreConfig,
)
from kvtier.store.packing import LayerKV, check_kv, pack_chunk, torch_dtype, unpack_layer
from kvtier.store.results import LoadResult, LookupResult, SaveResult, StoreStats
from kvtier.tiers.base import Tier, TierFullError
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.host import HostTier

log = logging.getLogger(__name__)


class KVStore:
    """Chunk-keyed KV cache of one model over a host DRAM tier, an optional SSD tier and an
    optional shared remote tier."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.layout = config.layout
        self.cache = ChunkCache(config.cache_config())
        self._chunk = Shape(self.layout.chunk_bytes, self.layout.layer_bytes)
        self._fmt = KVFormat.of_layout(self.layout)
        self._namespaces: dict[str, Namespace] = {}
        self._layer_tokens: Counter[str] = Counter()
        self._stats_lock = threading.Lock()

    # -- the cache's parts, for introspection -------------------------------------------------
    @property
    def tiers(self) -> list[Tier]:
        return self.cache.tiers

    @property
    def host(self) -> HostTier:
        return self.cache.host

    @property
    def remote(self) -> Tier | None:
        return self.cache.remote

    @property
    def remote_level(self) -> int | None:
        return self.cache.remote_level

    @property
    def placement(self) -> Placement:
        return self.cache.placement

    @property
    def index(self) -> ChunkIndex:
        return self.cache.index

    @property
    def stats(self) -> StoreStats:
        return self.cache.recorded_stats()

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.cache.tiers]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until background work (uploads to the remote tier, write-through copies) is
        done; False on timeout."""
        return self.cache.flush(timeout)

    # -- keys ---------------------------------------------------------------------------------
    def namespace(self, tenant: str | None = None) -> Namespace:
        tenant = self.config.tenant if tenant is None else tenant
        ns = self._namespaces.get(tenant)
        if ns is None:
            ns = Namespace(self.config.model, self.layout.fingerprint, tenant)
            self._namespaces[tenant] = ns
        return ns

    def keys_for(self, tokens: object, *, tenant: str | None = None,
                 extras: Mapping[int, bytes] | None = None) -> list[ChunkKey]:
        """The store keys of the full chunks of ``tokens``: chained under the model and layout,
        bound to the tenant (as a daemon binds its clients' keys)."""
        chain = chunk_tokens_of(tokens, self.namespace(""), self.layout.chunk_tokens, extras)
        return self._bind(tenant, chain.keys)

    def _bind(self, tenant: str | None, keys: list[ChunkKey]) -> list[ChunkKey]:
        return bind_keys(self.namespace(tenant), keys)

    def _tenant(self, tenant: str | None) -> str:
        return self.config.tenant if tenant is None else tenant

    # -- requests -----------------------------------------------------------------------------
    def queued(self, request_id: str, keys: Sequence[ChunkKey]) -> int:
        """A request arrived and waits to be served; it will need ``keys``. The policies with a
        look-ahead hear of it (AttentionStore's window: its chunks are kept over others), and
        its held chunks are prefetched into DRAM. Returns how many were promoted. Call
        :meth:`started` when it is scheduled."""
        return self.cache.queued(request_id, keys)

    def started(self, request_id: str) -> None:
        """The request is being served (call before its lookup; also for a request never
        :meth:`queued`). Its ``lookup``, ``load`` and ``save`` with ``request=request_id`` are
        then one use of each chunk for the policies."""
        self.cache.started(request_id)

    def finished(self, request_id: str) -> None:
        """The request's reply is done (call when the user has it; saves of its last chunks may
        still follow with ``request=request_id``): a conversation's next turn comes a think
        time after this, which ``returns`` learns."""
        self.cache.finished(request_id)

    def prefetch(self, keys: Sequence[ChunkKey], wait: bool = True) -> int:
        """Promote the held prefix of ``keys`` into DRAM ahead of use (a scheduler hint).
        Returns how many chunks were promoted; stops at the first chunk held nowhere."""
        return self.cache.prefetch(keys, wait=wait)

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, tokens: object, *, tenant: str | None = None,
               extras: Mapping[int, bytes] | None = None, request: str | None = None) -> LookupResult:
        """Longest run of cached chunks from the first. Raises TypeError/ValueError on bad tokens.
        ``extras``: per chunk, what besides tokens determines its KV (image content hashes, see
        :func:`kvtier.core.keys.image_extras`); give the same to :meth:`save`."""
        chunks = chunk_tokens_of(tokens, self.namespace(""), self.layout.chunk_tokens, extras)
        return self.lookup_keys(self._bind(tenant, chunks.keys), chunks.num_tokens, request=request,
                                tenant=self._tenant(tenant))

    def lookup_keys(self, keys: Sequence[ChunkKey], num_tokens: int | None = None, *,
                    request: str | None = None, tenant: str | None = None) -> LookupResult:
        """:meth:`lookup` for store keys already computed (:meth:`keys_for` of ``tenant``)."""
        c = self.layout.chunk_tokens
        n = len(keys) * c if num_tokens is None else num_tokens
        hit = self.cache.lookup_keys(keys, use=self.cache.use_of(request), tokens=(n, c),
                                     tenant=self._tenant(tenant))
        return LookupResult(num_tokens=n, hit_tokens=len(hit) * c, keys=hit.keys,
                            tiers=[self.cache.tiers[lvl].name for lvl in hit.levels])

    # -- load ---------------------------------------------------------------------------------
    def load(
        self,
        hit: LookupResult,
        out: Sequence[LayerKV] | None = None,
        *,
        layers: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        promote: bool = True,
        request: str | None = None,
    ) -> LoadResult:
        """Read the KV of ``hit``'s chunks.

        ``out``: per-layer tensors to fill (``[heads, >= hit_tokens, head_dim]``, any device);
        by default new tensors on ``device`` (CPU) are returned. ``layers``: only these layers
        (others of ``out`` are left untouched). Chunks on SSD are promoted to DRAM, unless
        ``promote`` is False: then only the requested layers are read from SSD (layer-wise
        loading reads one layer of every chunk at a time; :meth:`prefetch` promotes later).
        """
        layout = self.layout
        c = layout.chunk_tokens
        wanted = list(range(layout.num_layers)) if layers is None else list(layers)
        for layer in wanted:
            layout.layer_offset(layer)  # raises IndexError on a bad layer
        if out is None:
            buf = torch.empty(
                (layout.num_layers, layout.kv, layout.num_kv_heads, hit.hit_tokens, layout.head_dim),
                dtype=torch_dtype(layout),
                device=device,
            )
            out = [tuple(buf[layer].unbind(0)) for layer in range(layout.num_layers)]
        else:
            out, got = check_kv(out, layout)
            if got < hit.hit_tokens:
                raise ValueError(f"out holds {got} tokens, the hit has {hit.hit_tokens}")
        use = self.cache.use_of(request)
        read_from: list[str] = []  # where each chunk was read (DRAM once promoted)
        found_in: list[str] = []  # where each chunk was found
        if promote:
            held = self.cache.acquire(hit.keys, entry=self._chunk, touch=False)
            try:
                for i, h in enumerate(held):
                    self._unpack(self.host.arena.tensor[h.offset : h.offset + h.nbytes], out, i, wanted)
                    read_from.append("host")
                    found_in.append(h.source)
            finally:
                self.cache.release([h.key for h in held])
        for i in range(len(read_from), len(hit.keys)):  # DRAM had no room: read them in place
            key = hit.keys[i]
            got = self.cache.read(key, lambda level, tier, i=i, key=key: self._read_layers(
                level, tier, key, out, i, wanted), promote=False)
            if got is None:
                break
            read_from.append(got[0])
            found_in.append(self.cache.tiers[got[1]].name)
        self.cache.touch(hit.keys[: len(read_from)], use=use)
        with self._stats_lock:
            for name in found_in:  # in layer-tokens: a layer-by-layer load counts once
                self._layer_tokens[name] += c * len(wanted)
        loaded_from = read_from
        tokens = len(loaded_from) * c
        kv = [tuple(t[:, :tokens] for t in pair) for pair in out]
        return LoadResult(tokens=tokens, kv=kv, tiers=loaded_from)

    def _unpack(self, whole: torch.Tensor, out: Sequence[LayerKV], i: int, layers: list[int]) -> None:
        layout = self.layout
        for layer in layers:
            lo = layout.layer_offset(layer)
            unpack_layer(whole[lo : lo + layout.layer_bytes], out[layer], i, layout)

    def _read_layers(self, level: int, tier: Tier, key: ChunkKey, out: Sequence[LayerKV], i: int,
                     layers: list[int]) -> str | None:
        """Copy ``layers`` of chunk ``key`` (pinned at ``level``) into position ``i`` of ``out``."""
        layout = self.layout
        if level == 0:
            self._unpack(self.host.view(key), out, i, layers)  # DRAM: zero-copy, one view
            return tier.name
        for layer in layers:
            lo = layout.layer_offset(layer)
            raw = tier.get(key, offset=lo, length=layout.layer_bytes)
            if raw is None:
                return None
            unpack_layer(raw, out[layer], i, layout)
        return tier.name

    def read_entry(self, key: ChunkKey, promote: bool = True) -> tuple[torch.Tensor, str] | None:
        """A copy of one entry's bytes (a part of a typed object) and the tier it was found in
        (before any promotion); None on a miss. Damage found on the way is counted and
        forgotten, as for chunks."""
        got = self.cache.read(key, lambda level, tier: tier.get(key), promote=promote)
        return (got[0], self.cache.tiers[got[1]].name) if got is not None else None

    # -- save ---------------------------------------------------------------------------------
    def save(self, tokens: object, kv: Sequence[Sequence[torch.Tensor]], *, tenant: str | None = None,
             extras: Mapping[int, bytes] | None = None, request: str | None = None) -> SaveResult:
        """Store the full chunks of ``tokens`` not held yet. ``kv[layer]`` is ``(K, V)`` covering
        the first ``T <= len(tokens)`` tokens; chunks beyond ``T`` are not saved. Returns once
        they are stored and, with ``write_through``, once each stored chunk is on SSD or known
        not to have got there (counted in ``unpersisted``; see :class:`SaveResult`)."""
        layers, kv_tokens = check_kv(kv, self.layout)
        chunks = chunk_tokens_of(tokens, self.namespace(""), self.layout.chunk_tokens, extras)
        if kv_tokens > chunks.num_tokens:
            raise ValueError(f"kv covers {kv_tokens} tokens but only {chunks.num_tokens} tokens were given")
        keys = self._bind(tenant, chunks.keys[: kv_tokens // self.layout.chunk_tokens])
        stored = present = busy = dropped = 0
        pending = []
        for i, key in enumerate(keys):
            try:
                res = self.cache.reserve(key, self._chunk, position=i, remaining=len(keys) - i, fmt=self._fmt,
                                         tenant=self._tenant(tenant))
            except TierFullError:
                dropped += len(keys) - i  # a later chunk without this one could never hit
                break
            if res is Slot.HELD:
                present += 1
                continue
            if res is Slot.BUSY:
                busy += 1
                continue
            try:
                pack_chunk(res.buffer, layers, i, self.layout)
            except BaseException:
                self.cache.commit(res, ok=False)
                raise
            done = self.cache.commit(res, position=i)
            stored += bool(done)
            pending.append(done)
        self.cache.touch(keys, use=self.cache.use_of(request, finished=True))
        self.cache.count(dedup_chunks=present, busy_chunks=busy, dropped_chunks=dropped)
        unpersisted = wait_all(pending)
        return SaveResult(stored=stored, present=present, dropped=dropped, busy=busy, unpersisted=unpersisted)

    # -- introspection ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, object]:
        """Capacity, use and counters per tier, and the store's own counters."""
        snap = self.cache.snapshot()
        with self._stats_lock:
            snap["loaded_tokens"] = {k: v // self.layout.num_layers for k, v in self._layer_tokens.items()}
        return snap

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Held", "KVStore", "LoadResult", "LookupResult", "RemoteConfig", "SaveResult", "StoreConfig"]
