"""KVStore: the facade an engine talks to.

    store = KVStore(StoreConfig(model="llama-3-8b@abc", layout=layout,
                                host=HostTierConfig(8 << 30), disk=DiskTierConfig("/ssd/kv", 200 << 30)))
    hit = store.lookup(tokens)                 # how many tokens are cached, and where
    loaded = store.load(hit)                   # per-layer (K, V) for the first loaded.tokens tokens
    store.save(tokens, kv)                     # new full chunks go to DRAM

Tiers are ordered fastest first (host DRAM, then SSD). Which chunk goes where is decided by a
:class:`~kvtier.core.placement.Placement` (the same object ``kvtier replay`` measures), and this
module moves the bytes (:class:`TierMover`). A chunk saved goes to DRAM; when DRAM is full the
policy's victim is demoted to SSD (written there unless SSD already holds it) rather than
dropped; when SSD is full its victim is dropped. A chunk loaded from SSD is promoted to DRAM
(keeping its SSD copy). Everything read is pinned in its tier for the duration of the copy.

Failure contract: a chunk that cannot be read (missing file, checksum mismatch) ends the prefix
at that chunk: ``load`` returns fewer tokens than ``lookup`` promised, never wrong bytes, and the
damage is counted in the tier's stats. Bad arguments raise before anything is changed.

Thread-safety: every public method takes the store's lock; calls may come from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Self, TypeVar

import torch

from kvtier.core.keys import ChunkKey, Namespace, chunk_tokens_of
from kvtier.core.placement import Placement
from kvtier.core.policies.base import TierContext
from kvtier.core.policy import make_policy
from kvtier.mover import TierMover, Uploader
from kvtier.store_types import (  # noqa: F401 (re-exported: the store's public types)
    MAX_WAITING,
    NOMINAL_READ_BPS,
    WRITE_MODES,
    LoadResult,
    LookupResult,
    RemoteConfig,
    SaveResult,
    StoreConfig,
    StoreStats,
    make_remote_tier,
)
from kvtier.tiers.base import Reservation, Tier, TierFullError
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.transfer import LayerKV, check_kv, pack_chunk, torch_dtype, unpack_layer

log = logging.getLogger(__name__)
T = TypeVar("T")

class KVStore:
    """Chunk-keyed KV cache over a host DRAM tier and an optional SSD tier."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.layout = config.layout
        self._lock = threading.RLock()
        self._namespaces: dict[str, Namespace] = {}
        # policies first: a bad one must fail before any tier takes memory or a directory lock
        kinds = ["host"] + ["disk"] * (config.disk is not None) + ["remote"] * (config.remote is not None)
        policies = [
            make_policy(config.policy, TierContext(
                level=level, chunk_tokens=self.layout.chunk_tokens,
                chunk_load_s=self.layout.chunk_bytes / NOMINAL_READ_BPS[kind],
            ))
            for level, kind in enumerate(kinds)
        ]
        host = HostTier(config.host, slot_bytes=self.layout.chunk_bytes)
        self.tiers: list[Tier] = [host]
        self.remote: Tier | None = None
        self.uploader: Uploader | None = None
        try:
            if config.disk is not None:
                self.tiers.append(DiskTier(config.disk))
            if config.remote is not None:
                self.remote = make_remote_tier(config.remote.tier)
                self.tiers.append(self.remote)
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        self.host = host
        for tier in self.tiers:
            need = tier.footprint(self.layout.chunk_bytes, self.layout.layer_bytes)
            if need > tier.capacity:
                self.close()
                raise ValueError(
                    f"{tier.name} capacity of {tier.capacity} bytes cannot hold one chunk "
                    f"({need} bytes for {self.layout.chunk_tokens} tokens of this layout)"
                )
        if self.remote is not None:
            self.uploader = Uploader(self.remote, self.layout.layer_bytes, config.remote.max_queued)
        self.remote_level = len(self.tiers) - 1 if self.remote is not None else None
        mover = TierMover(self.tiers, host, self.layout, self.uploader, self._uploaded)
        self.placement = Placement(policies, mover)
        self.mover = mover
        self._next_seq = 0
        self._waiting: dict[str, int] = {}
        self.index = self.placement.index
        self.stats = StoreStats()
        for level, tier in enumerate(self.tiers):
            if level == self.remote_level:
                continue  # shared and large: its chunks are found by lookups, not listed
            for key in tier.keys():  # persistent tiers come back with their chunks, oldest first
                self.placement.added(key, level)
            while tier.used > tier.capacity and self.placement.evict(level):
                pass

    def _uploaded(self, key: ChunkKey, ok: bool) -> None:
        """The uploader finished a chunk (its thread)."""
        if ok:
            with self._lock:
                self.placement.added(key, self.remote_level)  # type: ignore[arg-type]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every chunk queued for the remote tier is uploaded (or failed); False on
        timeout. Without a remote tier, True at once."""
        return self.uploader.flush(timeout) if self.uploader is not None else True

    # -- keys ---------------------------------------------------------------------------------
    def namespace(self, tenant: str | None = None) -> Namespace:
        tenant = self.config.tenant if tenant is None else tenant
        ns = self._namespaces.get(tenant)
        if ns is None:
            ns = Namespace(self.config.model, self.layout.fingerprint, tenant)
            self._namespaces[tenant] = ns
        return ns

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, tokens: object, *, tenant: str | None = None,
               extras: Mapping[int, bytes] | None = None) -> LookupResult:
        """Longest run of cached chunks from the first. Raises TypeError/ValueError on bad tokens.
        ``extras``: per chunk, what besides tokens determines its KV (image content hashes, see
        :func:`kvtier.core.keys.image_extras`); give the same to :meth:`save`."""
        chunks = chunk_tokens_of(tokens, self.namespace(tenant), self.layout.chunk_tokens, extras)
        return self.lookup_keys(chunks.keys, chunks.num_tokens)

    def lookup_keys(self, keys: Sequence[ChunkKey], num_tokens: int | None = None) -> LookupResult:
        """:meth:`lookup` for keys already computed (by a client of the store daemon)."""
        c = self.layout.chunk_tokens
        with self._lock:
            self._probe_remote(keys)
            hit = self.placement.lookup(keys)
            st = self.stats
            st.lookups += 1
            st.lookup_tokens += len(keys) * c if num_tokens is None else num_tokens
            st.hit_tokens += len(hit) * c
            absent = len(keys) - len(hit)
            for level, tier in enumerate(self.tiers):
                st.hits[tier.name] += hit.levels.count(level)
                st.misses[tier.name] += absent + sum(1 for lvl in hit.levels if lvl > level)
        return LookupResult(
            num_tokens=len(keys) * c if num_tokens is None else num_tokens,
            hit_tokens=len(hit) * c,
            keys=hit.keys,
            tiers=[self.tiers[lvl].name for lvl in hit.levels],
        )

    def _probe_remote(self, keys: Sequence[ChunkKey]) -> None:
        """Chunks past the locally known prefix may be in the shared remote tier (saved by
        another instance): ask it, in order, and index those it holds."""
        if self.remote is None:
            return
        level = self.remote_level
        held = len(self.index.longest_prefix(keys))
        rest = keys[held:]
        for key in rest[: self.remote.contains_prefix(rest)]:  # one round trip; 0 when down
            self.placement.added(key, level)  # type: ignore[arg-type]

    # -- load ---------------------------------------------------------------------------------
    def load(
        self,
        hit: LookupResult,
        out: Sequence[LayerKV] | None = None,
        *,
        layers: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        promote: bool = True,
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
        loaded_from: list[str] = []
        with self._lock:
            if promote and self.remote_level is not None:  # one round trip a run, not one a chunk
                lost = self.placement.stats.lost
                self.placement.promote_prefix(hit.keys, level=self.remote_level)
                self.stats.load_failures += self.placement.stats.lost - lost
            for i, key in enumerate(hit.keys):
                source = self._read_chunk(key, out, i, wanted, promote)
                if source is None:
                    break
                loaded_from.append(source)
            self.placement.touch(hit.keys[: len(loaded_from)])
            for name in loaded_from:  # in layer-tokens: a layer-by-layer load counts once
                self.stats.loaded_layer_tokens[name] += c * len(wanted)
        tokens = len(loaded_from) * c
        kv = [tuple(t[:, :tokens] for t in pair) for pair in out]
        return LoadResult(tokens=tokens, kv=kv, tiers=loaded_from)

    def _read_chunk(
        self, key: ChunkKey, out: Sequence[LayerKV], i: int, layers: list[int], promote: bool
    ) -> str | None:
        """Copy chunk ``key`` into position ``i`` of ``out``; the tier read from, or None."""
        layout = self.layout

        def read(level: int, tier: Tier) -> str | None:
            whole = self.host.view(key) if level == 0 else None  # DRAM: zero-copy, one view
            for layer in layers:
                lo = layout.layer_offset(layer)
                if whole is not None:
                    raw = whole[lo : lo + layout.layer_bytes]
                else:
                    raw = tier.get(key, offset=lo, length=layout.layer_bytes)
                    if raw is None:
                        return None
                unpack_layer(raw, out[layer], i, layout)
            return tier.name

        got = self._read(key, promote, read)
        return got[0] if got is not None else None

    def _read(self, key: ChunkKey, promote: bool,
              read: Callable[[int, Tier], T | None]) -> tuple[T, int] | None:
        """``read(level, tier)`` the chunk, pinned, from the tier the placement picks (promoting
        it into DRAM first when ``promote``); with the level it was found in before promotion.
        A failed read is counted, that copy forgotten, and the next tier tried; None if none
        could be read. Call under the store's lock."""
        while (found := self.index.fastest(key)) is not None:
            level = self.placement.source(key, promote)
            tier = self.tiers[level]  # type: ignore[index]
            with tier.pinned(key) as held:
                got = read(level, tier) if held else None  # type: ignore[arg-type]
            if got is not None:
                return got, found
            self.stats.load_failures += 1
            self._forget(key, level)  # type: ignore[arg-type]
        return None

    def prefetch(self, keys: Sequence[ChunkKey]) -> int:
        """Promote the held prefix of ``keys`` into DRAM ahead of use (a scheduler hint).
        Returns how many chunks were promoted; stops at the first chunk held nowhere."""
        with self._lock:
            return self.placement.prefetch(list(keys))

    # -- scheduler hooks ----------------------------------------------------------------------
    def queued(self, request_id: str, keys: Sequence[ChunkKey]) -> int:
        """A request arrived and waits to be served; it will need ``keys``. It gets the next
        number in arrival order, the policies with a look-ahead hear of it (AttentionStore's
        window: its chunks are kept over others), and its held chunks are prefetched into DRAM.
        Returns how many were promoted. Call :meth:`started` when it is scheduled."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._waiting[request_id] = seq
            while len(self._waiting) > MAX_WAITING:  # never started (aborted): forget the oldest
                self._waiting.pop(next(iter(self._waiting)))
            keys = list(keys)
            if self.placement.lookahead:
                self.placement.hint(seq, keys)
            return self.placement.prefetch(keys)

    def started(self, request_id: str) -> None:
        """The request announced by :meth:`queued` is being served (before its lookup). Requests
        are assumed to start roughly in arrival order: starting one also ends the look-ahead
        protection of those that arrived before it. Unknown ids are ignored."""
        with self._lock:
            seq = self._waiting.pop(request_id, None)
            if seq is not None:
                self.placement.begin(seq, time.monotonic())

    # -- save ---------------------------------------------------------------------------------
    def save(self, tokens: object, kv: Sequence[Sequence[torch.Tensor]], *, tenant: str | None = None,
             extras: Mapping[int, bytes] | None = None) -> SaveResult:
        """Store the full chunks of ``tokens`` not held yet. ``kv[layer]`` is ``(K, V)`` covering
        the first ``T <= len(tokens)`` tokens; chunks beyond ``T`` are not saved."""
        layers, kv_tokens = check_kv(kv, self.layout)
        chunks = chunk_tokens_of(tokens, self.namespace(tenant), self.layout.chunk_tokens, extras)
        if kv_tokens > chunks.num_tokens:
            raise ValueError(f"kv covers {kv_tokens} tokens but only {chunks.num_tokens} tokens were given")
        keys = chunks.keys[: kv_tokens // self.layout.chunk_tokens]
        stored = present = dropped = 0
        with self._lock:
            for i, key in enumerate(keys):
                try:
                    res = self.reserve_chunk(key, position=i)
                except TierFullError:
                    dropped += len(keys) - i  # a later chunk without this one could never hit
                    break
                if res is None:
                    present += 1
                    continue
                try:
                    pack_chunk(res.buffer, layers, i, self.layout)
                except BaseException:
                    self.commit_chunk(res, ok=False)
                    raise
                stored += self.commit_chunk(res)
            self.placement.touch(keys)
            self.stats.dedup_chunks += present
            self.stats.dropped_chunks += dropped
        return SaveResult(stored=stored, present=present, dropped=dropped)

    def read_entry(self, key: ChunkKey, promote: bool = True) -> tuple[torch.Tensor, str] | None:
        """A copy of one entry's bytes (a part of a typed object) and the tier it was found in
        (before any promotion); None on a miss. Damage found on the way is counted and
        forgotten, as for chunks."""
        with self._lock:
            got = self._read(key, promote, lambda level, tier: tier.get(key))
            return (got[0], self.tiers[got[1]].name) if got is not None else None

    # -- key-level access (for the store daemon's clients, which share the DRAM arena) -------
    def reserve_chunk(self, key: ChunkKey, position: int | None = None,
                      nbytes: int | None = None) -> Reservation | None:
        """Take a DRAM slot for a new chunk (evicting as needed); fill ``res.buffer`` (or the
        arena at ``res.slot``), then :meth:`commit_chunk`. None if the chunk is already held.
        Raises TierFullError if every resident chunk is pinned or the policy does not admit
        chunk ``position`` of its sequence. ``nbytes``: a smaller entry than a KV chunk (a part
        of a typed object); ValueError if larger."""
        if nbytes is not None and not 0 < nbytes <= self.layout.chunk_bytes:
            raise ValueError(f"an entry holds 1 to {self.layout.chunk_bytes} bytes, got {nbytes}")
        with self._lock:
            if key in self.index:
                return None
            if not self.placement.room_for_new(key, position):
                raise TierFullError(
                    f"no DRAM slot for the chunk: the {self.config.policy} policy did not admit "
                    "it, or every resident chunk is pinned"
                )
            size = self.layout.chunk_bytes if nbytes is None else nbytes
            return self.host.reserve(key, size, min(size, self.layout.layer_bytes))

    def commit_chunk(self, res: Reservation, ok: bool = True) -> bool:
        """Publish (or abandon) a reserved chunk; with ``write_through``, copy it to SSD too."""
        with self._lock:
            if not self.host.commit(res, ok=ok):
                return False
            self.placement.added(res.key, 0)
            self.stats.saved_chunks += 1
            if self.config.write_through and self.config.disk is not None:
                self.placement.demote(res.key, 0)
            if self.config.remote is not None and self.config.remote.write == "through":
                self._upload_from_dram(res.key)
            return True

    def _upload_from_dram(self, key: ChunkKey) -> None:
        """Queue a saved chunk for the remote tier straight from its DRAM slot, pinned until
        the upload is over (no copy)."""
        if self.index.holds(key, self.remote_level) or not self.host.pin(key):  # type: ignore[arg-type]
            return

        def unpin() -> None:
            with self._lock:
                self.host.unpin(key)

        if self.mover.upload(key, self.host.view(key), after=unpin):
            self.placement.stats.writes_down[self.remote_level] += 1  # type: ignore[index]
        else:
            self.host.unpin(key)

    def acquire(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Pin the longest held prefix of ``keys`` in DRAM, promoting chunks from SSD, and
        return their arena slot indices. The caller reads the slots, then calls
        :meth:`release` with ``keys[:len(slots)]``."""
        slots: list[int] = []
        with self._lock:
            for key in keys:
                level = self.index.fastest(key)
                if level is None or (level > 0 and not self.placement.promote(key, level)):
                    break
                if not self.host.pin(key):
                    break
                slots.append(self.host.slot_of(key))  # type: ignore[arg-type]
                self.stats.loaded_layer_tokens[self.tiers[level].name] += (
                    self.layout.chunk_tokens * self.layout.num_layers
                )
            self.placement.touch(list(keys[: len(slots)]))
        return slots

    def release(self, keys: Sequence[ChunkKey]) -> None:
        """Undo :meth:`acquire`'s pins."""
        with self._lock:
            for key in keys:
                self.host.unpin(key)

    # -- placement ----------------------------------------------------------------------------
    def _forget(self, key: ChunkKey, level: int) -> None:
        """The tier lost the chunk (damage found on read): drop it from the index."""
        self.placement.forget(key, level)
        tier = self.tiers[level]
        if tier.contains(key) and not tier.is_pinned(key):
            tier.delete(key)

    # -- introspection ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, object]:
        """Capacity, use and counters per tier, and the store's own counters."""
        with self._lock:
            s, ps = self.stats, self.placement.stats
            return {
                "tiers": {
                    t.name: {
                        "capacity_bytes": t.capacity,
                        "used_bytes": t.used,
                        "chunks": self.index.count(level),
                        "hits": s.hits[t.name],
                        "misses": s.misses[t.name],
                        "evictions": ps.evictions[level],
                        "io": t.stats.as_dict(),
                    }
                    for level, t in enumerate(self.tiers)
                },
                "lookups": s.lookups,
                "lookup_tokens": s.lookup_tokens,
                "hit_tokens": s.hit_tokens,
                "loaded_tokens": {
                    k: v // self.layout.num_layers for k, v in s.loaded_layer_tokens.items()
                },
                "saved_chunks": s.saved_chunks,
                "dedup_chunks": s.dedup_chunks,
                "dropped_chunks": s.dropped_chunks,
                "demotions": sum(ps.writes_down[1:]),
                "promotions": ps.promotions,
                "load_failures": s.load_failures,
                "uploads": asdict(self.uploader.stats) if self.uploader is not None else {},
            }

    def close(self) -> None:
        if self.uploader is not None:
            self.uploader.flush(timeout=30)
            self.uploader.close()
        with self._lock:  # the remote tier first: it waits for reads it gave up on into DRAM slots
            for tier in reversed(self.tiers):
                tier.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

