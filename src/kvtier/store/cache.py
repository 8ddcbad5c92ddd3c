"""ChunkCache: entries keyed by :data:`ChunkKey` across DRAM, SSD and a remote tier, shared by
threads.

The store's engine, below the :class:`~kvtier.store.KVStore` facade (which knows one model's KV
layout and packs tensors) and the store daemon (whose clients say what their chunks are). It
knows no layout: an entry is bytes in parts of ``segment_bytes`` (a layer of a chunk).

Locking: one lock, held for bookkeeping only -- the index, the policies, the tiers' slot and
space accounting, pins. Every byte copy, file read or write and network round trip happens with
the lock released: a :class:`~kvtier.core.placement.Placement` decision is carried out by the
:class:`~kvtier.store.moves.TierMover` on the transfer handler of its pair of tiers while other
threads go on (see :mod:`kvtier.store.moves` for the entry states that keep that safe), and the
remote tier is probed outside it. Any number of threads may call any method.

Entry lifecycle, as a caller sees it:

- ``reserve`` a DRAM slot for a new entry (``Held``: some tier has it; ``Busy``: someone is
  writing it right now -- skip it, nothing failed), fill ``res.buffer``, ``commit`` (or abandon
  with ``ok=False``). Uncommitted, the entry is invisible to lookups.
- ``acquire`` pins the longest held prefix of a sequence in DRAM (promoting from SSD or the
  remote tier); the bytes stay in their slots until ``release``.
- ``read`` copies one entry out, pinned while it is read, from wherever it is.

Failure contract: an entry that cannot be read (checksum, missing file, server down) is a miss
that is counted and forgotten; wrong bytes are never returned.

This module holds the cache's tiers, lock and background work; its other parts
are in :mod:`~kvtier.store.cache_lookups`, :mod:`~kvtier.store.cache_reads`,
:mod:`~kvtier.store.cache_writes`, :mod:`~kvtier.store.cache_requests` (request hooks and
session hints) and :mod:`~kvtier.store.cache_counters`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Self, TypeVar

from kvtier.core.index import PrefixHit
from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.core.placement import Placement
from kvtier.core.policies.base import TierContext
from kvtier.core.policies.hinted import hinted_policies
from kvtier.core.policy import make_policy
from kvtier.core.sessions import SessionBook
from kvtier.store.cache_counters import CacheCounters
from kvtier.store.cache_lookups import CacheLookups
from kvtier.store.cache_reads import CacheReads
from kvtier.store.cache_requests import CacheRequests
from kvtier.store.cache_writes import CacheWrites, wait_all
from kvtier.store.config import (
    NOMINAL_CHUNK_BYTES,
    NOMINAL_READ_BPS,
    CacheConfig,
    Held,
    Slot,
)
from kvtier.store.moves import TierMover
from kvtier.store.remote_level import RemoteLevel, make_remote
from kvtier.store.request_numbers import Requests
from kvtier.store.results import StoreStats
from kvtier.store.uploader import Uploader
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_QUEUED_PREFETCHES = 256
"""Prefetches waiting for the background threads at most; more hints are dropped (counted)."""


class _Section:
    """``with cache._section:`` -- the cache's lock, and the lookups made without it recorded
    first (their touches come before any eviction the section makes, and every count read is
    whole)."""

    def __init__(self, lock: threading.Lock, record: Callable[[], None]) -> None:
        self._lock = lock
        self._record = record

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            self._record()
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class ChunkCache(CacheLookups, CacheReads, CacheWrites, CacheCounters, CacheRequests):
    """Entries across a host DRAM tier, an optional SSD tier and an optional remote tier."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        chunk_bytes = config.chunk.nbytes if config.chunk else NOMINAL_CHUNK_BYTES
        # policies first: a bad one must fail before any tier takes memory or a directory lock
        kinds = ["host"] + ["disk"] * (config.disk is not None) + ["remote"] * (config.remote is not None)
        policies = [
            make_policy(config.policy, TierContext(
                level=level, chunk_tokens=config.chunk_tokens,
                chunk_load_s=chunk_bytes / NOMINAL_READ_BPS[kind], costs_known=False,
            ))
            for level, kind in enumerate(kinds)
        ]
        host = HostTier(config.host, slot_bytes=config.chunk.nbytes if config.chunk else None)
        self.tiers: list[Tier] = [host]
        self.remote: Tier | None = None
        self.disk: DiskTier | None = None
        try:
            if config.disk is not None:
                self.disk = DiskTier(config.disk)
                self.tiers.append(self.disk)
            if config.remote is not None:
                self.remote = make_remote(config.remote.tier, lambda key: self._tenant_of(key))
                self.tiers.append(self.remote)
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        self.host = host
        if config.chunk is not None:
            for tier in self.tiers:
                need = tier.footprint(config.chunk.nbytes, config.chunk.segment_bytes)
                if need > tier.capacity:
                    for t in self.tiers:
                        t.close()
                    raise ValueError(
                        f"{tier.name} capacity of {tier.capacity} bytes cannot hold one chunk "
                        f"({need} bytes for {config.chunk_tokens} tokens of this layout)"
                    )
        self.uploader: Uploader | None = None
        if self.remote is not None:
            self.uploader = Uploader(self.remote, config.chunk.segment_bytes if config.chunk else None,
                                     config.remote.max_queued)  # type: ignore[union-attr]
        self.remote_level = len(self.tiers) - 1 if self.remote is not None else None
        self._lock = threading.Lock()
        self._section = _Section(self._lock, self._record_lookups)
        self.mover = TierMover(self.tiers, host, config.chunk, self.uploader,
                               lambda key, ok, tenant: self._remote_level.uploaded(key, ok, tenant),  # type: ignore[union-attr]
                               self._lock, position_of=lambda key: self.index.position(key),
                               tenant_of=lambda key: self._tenant_of(key))
        self._changed = self.mover.changed
        self.mover.on_relock = self._record_lookups
        # session hints rank chunks in every tier over its policy (:mod:`kvtier.core.sessions`)
        local = sum(t.capacity for t in self.tiers if t is not self.remote)
        self.sessions = SessionBook(len(self.tiers), local, config.hint_share)
        self.placement = Placement(hinted_policies(policies, self.sessions), self.mover)
        self.index = self.placement.index
        self.sessions.bind(self.index.holds)
        self._remote_level: RemoteLevel | None = None
        if self.remote is not None:
            self._remote_level = RemoteLevel(self.remote, self.remote_level, self.placement, self._lock,  # type: ignore[arg-type]
                                             config.remote.verify_s, config.remote.miss_s)  # type: ignore[union-attr]
        self.stats = StoreStats()
        self._background = ThreadPoolExecutor(2, thread_name_prefix="kvtier-background")
        self._requests = Requests()
        self._queued_prefetches = 0
        self._pending: set[Future] = set()
        self._lookups: deque[tuple[PrefixHit, int, int | None, tuple[int, int] | None]] = deque()
        self._closed = False
        self._ticks: threading.Thread | None = None
        self._stop_ticks = threading.Event()
        with self._section:
            for level, tier in enumerate(self.tiers):
                if level == self.remote_level:
                    continue  # shared and large: its chunks are found by lookups, not listed
                for key in tier.keys():  # persistent tiers come back with their chunks, oldest first
                    position = tier.position_of(key) if isinstance(tier, DiskTier) else None
                    self.placement.added(key, level, position)
                    self.placement.touch([key], start=position or 0)  # ranked, not left unranked
                while tier.used > tier.capacity and self.placement.evict(level):
                    pass

    def _tenant_of(self, key: ChunkKey) -> str:
        """Whose chunk ``key`` is, for a remote tier that keeps tenants apart: the tenant of the
        request this thread serves (its keys are bound to it), else the one recorded with the
        chunk -- in DRAM, on SSD, or where the remote tier was found to hold it."""
        tenant = self.mover.current_tenant()
        if tenant is None:
            tenant = self.host.tenant_of(key)
        if tenant is None and self.disk is not None:
            tenant = self.disk.tenant_of(key)
        if tenant is None and self._remote_level is not None:
            tenant = self._remote_level.recorded_tenant(key)
        return tenant or ""

    # -- the lock -----------------------------------------------------------------------------
    def _shaped(self, entry: Shape | None, tenant: str | None = None,
                last: tuple[ChunkKey, Shape] | None = None) -> contextlib.AbstractContextManager[None]:
        """What this thread's moves need to know of the request's chunks: their shape (for ones
        coming up from the remote tier; ``last``: a partial chunk's own) and their tenant."""
        if entry is None and tenant is None and last is None:
            return contextlib.nullcontext()
        return self.mover.shaped(entry, tenant, last)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until background work (write-through copies, queued prefetches, uploads to the
        remote tier, SSD unlinks) is done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._section:
            pending = list(self._pending)
        for future in pending:  # everything submitted before this call
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(timeout=left)
            except TimeoutError:
                return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self.uploader is not None and not self.uploader.flush(left):
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.disk.flush_deletes(left) if self.disk is not None else True

    # -- prefetches and background work -------------------------------------------------------
    def prefetch(self, keys: Sequence[ChunkKey], *, start: int = 0, use: int | None = None,
                 entry: Shape | None = None, wait: bool = True, tenant: str | None = None) -> int:
        """Promote the held prefix of ``keys`` into DRAM ahead of use (a scheduler hint).
        Returns how many chunks were promoted (with ``wait=False`` the work is queued to a
        background thread and 0 is returned); stops at the first chunk held nowhere.
        ``tenant``: whose keys these are (None: the tenant each was found under)."""
        keys = list(keys)

        def work() -> int:
            with self._section, self._shaped(entry, tenant):
                return self.placement.prefetch(keys, start=start, use=use)

        if wait:
            return work()
        self._in_background(work)
        return 0

    def _in_background(self, work: Callable[[], int]) -> None:
        """Queue a prefetch to the background threads (dropped, counted, when too many wait).
        Outside the lock."""
        with self._section:
            if self._closed or self._queued_prefetches >= MAX_QUEUED_PREFETCHES:
                self.stats.prefetches_dropped += 1  # a storm of hints must not queue without end
                return
            self._queued_prefetches += 1

        def queued() -> int:
            try:
                return work()
            finally:
                with self._section:
                    self._queued_prefetches -= 1

        self._submit(queued)

    def _submit(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on a background thread; :meth:`flush` waits for it. Under the lock or not."""
        future = self._background.submit(self._logged, fn)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    @staticmethod
    def _logged(fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception:  # background work must never die silently
            log.exception("kvtier background work failed")
            return None

    # -- touches and DRAM pins ----------------------------------------------------------------
    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        with self._section:
            self.placement.touch(list(keys), cost_s, start=start, use=use)

    def pin_dram(self, key: ChunkKey) -> bool:
        with self._section:
            return self.host.pin(key)

    def unpin_dram(self, key: ChunkKey) -> None:
        with self._section:
            self.host.unpin(key)
            self._changed.notify_all()  # type: ignore[union-attr]

    def close(self) -> None:
        self._closed = True
        self._close_ticks()
        self._background.shutdown(wait=True)
        if self.uploader is not None:
            self.uploader.flush(timeout=30)
            self.uploader.close()  # an upload still running keeps its DRAM view, and the arena
        self.mover.close()
        with self._section:  # the remote tier first: it waits for reads it gave up on into DRAM slots
            for tier in reversed(self.tiers):
                tier.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CacheConfig", "ChunkCache", "Held", "Slot", "wait_all"]
