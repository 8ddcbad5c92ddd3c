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
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Self, TypeVar

from kvtier.core.index import PrefixHit
from kvtier.core.keys import ChunkKey
from kvtier.core.placement import Placement, Shape
from kvtier.core.policies.base import TierContext
from kvtier.core.policy import make_policy
from kvtier.store.config import (
    NOMINAL_CHUNK_BYTES,
    NOMINAL_READ_BPS,
    CacheConfig,
    EntryState,
    Held,
    Slot,
)
from kvtier.store.moves import TierMover
from kvtier.store.remote_level import RemoteLevel, make_remote
from kvtier.store.request_numbers import Requests
from kvtier.store.results import StoreStats
from kvtier.store.uploader import Uploader
from kvtier.tiers.base import Reservation, Tier, TierFullError
from kvtier.tiers.codecs import KVFormat
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_DEFERRED_LOOKUPS = 4096
"""Lookups whose touches wait for the lock at most; past that a lookup records them itself."""
MAX_QUEUED_PREFETCHES = 256
"""Prefetches waiting for the background threads at most; more hints are dropped (counted)."""
WRITE_THROUGH_TRIES = 3
"""Copies of one entry to SSD a write-through tries (another write may take the room made)."""
WRITE_THROUGH_RETRY_S = 0.1
"""How long a write-through waits for a change (a move ending) before it tries again."""
WRITE_THROUGH_WAIT_S = 30.0
"""How long a write-through waits for an eviction of its entry already copying it to SSD."""


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


class ChunkCache:
    """Entries across a host DRAM tier, an optional SSD tier and an optional remote tier."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        chunk_bytes = config.chunk.nbytes if config.chunk else NOMINAL_CHUNK_BYTES
        # policies first: a bad one must fail before any tier takes memory or a directory lock
        kinds = ["host"] + ["disk"] * (config.disk is not None) + ["remote"] * (config.remote is not None)
        policies = [
            make_policy(config.policy, TierContext(
                level=level, chunk_tokens=config.chunk_tokens,
                chunk_load_s=chunk_bytes / NOMINAL_READ_BPS[kind],
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
        self.placement = Placement(policies, self.mover)
        self.index = self.placement.index
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

    # -- requests (the policies' notion of a use) ---------------------------------------------
    def queued(self, request_id: str, keys: Sequence[ChunkKey], *, entry: Shape | None = None,
               wait: bool = True, tenant: str | None = None, prefetch: bool = True) -> int:
        """A request arrived and waits to be served; it will need ``keys`` (a prefix). It gets
        the next number in arrival order, the policies with a look-ahead hear of it, and its
        held chunks are prefetched into DRAM (now, or with ``wait=False`` in the background;
        not with ``prefetch=False``: a scheduler that promotes a request's chunks itself when
        it comes to the head of its queue). Returns how many were promoted (0 when not waited
        for)."""
        with self._section:
            seq = self._requests.queued(request_id)
            if self.placement.lookahead:
                self.placement.hint(seq, list(keys), time.monotonic())
        if not prefetch:
            return 0
        return self.prefetch(keys, use=seq, entry=entry, wait=wait, tenant=tenant)

    def started(self, request_id: str) -> int:
        """The request is being served (before its lookup): the policies ``begin`` it. A request
        never announced with :meth:`queued` gets its number now. Requests are assumed to start
        roughly in arrival order: starting one also ends the look-ahead protection of those that
        arrived before it. What the DRAM policy then stages (conversations it predicts are
        coming back, see :meth:`~kvtier.core.policies.base.EvictionPolicy.staging`) is
        prefetched in the background, as a hint is. Returns its number, the ``use`` of its
        touches."""
        staged: list[Sequence[ChunkKey]] = []
        with self._section:
            seq, new = self._requests.started(request_id)
            if new:
                now = time.monotonic()
                self.placement.begin(seq, now)
                staged = self.placement.staging(now)
        for keys in staged:  # outside the lock: prefetch takes it to queue the work
            self.prefetch(keys, wait=False)
        return seq

    def use_of(self, request_id: str | None, *, finished: bool = False) -> int | None:
        """The number of a queued or started request, with ``finished`` also of one finished
        lately (a save of its reply after its end); None for an unknown one. A few dict reads,
        without the lock: a lookup does not wait for it."""
        return self._requests.use_of(request_id, finished=finished)

    def arrived(self, request_id: str | None) -> int | None:
        """:meth:`use_of`, a request not known yet numbered as queued now (its lookup came
        before its :meth:`queued` hint, which then finds it: one use of each chunk, not two)."""
        seq = self._requests.use_of(request_id)
        if seq is None and request_id is not None:
            with self._section:
                seq = self._requests.queued(request_id)
        return seq

    def finished(self, request_id: str) -> None:
        """The request's reply is done (the policies hear when: a conversation's next turn
        comes a think time after it)."""
        with self._section:
            seq = self._requests.finished(request_id)
            if seq is not None:
                self.placement.finished(seq, time.monotonic())

    # -- lookup -------------------------------------------------------------------------------
    def lookup_keys(self, keys: Sequence[ChunkKey], *, use: int | None = None,
                    tokens: tuple[int, int] | None = None, tenant: str | None = None) -> PrefixHit:
        """The longest run of held chunks from the first (remote tier asked for those past the
        locally held prefix, outside the lock); touches them.

        Waits for nobody: the index is read without the lock (its reads are single dict reads;
        a lookup is advice -- every read that follows checks again what it finds), and the
        touch and the counts are recorded by whoever holds the lock next (at once if nobody
        does), so a lookup never queues behind another client's bookkeeping. ``tokens``: the
        lookup's (tokens looked up, tokens per chunk), for the token counts. ``tenant``: whose
        keys these are (a remote tier that keeps tenants apart is asked under it)."""
        keys = list(keys)
        if self._remote_level is not None:
            with self.mover.shaped(None, tenant):
                self._remote_level.probe(keys, tenant or "")
        hit = self.index.longest_prefix(keys)
        self._lookups.append((hit, len(keys), use, tokens))
        if len(self._lookups) > MAX_DEFERRED_LOOKUPS:
            with self._section:  # records them on entry
                pass
        elif self._lock.acquire(blocking=False):
            try:
                self._record_lookups()
            finally:
                self._lock.release()
        return hit

    def held(self, keys: Sequence[ChunkKey], *, tenant: str | None = None,
             remote: bool = False) -> list[int | None]:
        """The fastest level holding each of ``keys``, each on its own (not a prefix; None: not
        held). Lock-free as :meth:`lookup_keys` is, and advice as it is; touches and counts
        nothing: it probes candidates (the partial chunks an engine may have saved) and the
        engine's load of the one it picks is what counts. ``remote``: the remote tier is asked
        (one round trip, outside the lock) for those held nowhere here -- a partial chunk
        another machine saved -- else only what the index knows is answered."""
        if remote and self._remote_level is not None:
            with self.mover.shaped(None, tenant):
                self._remote_level.probe_each(list(keys), tenant or "")
        return [self.index.fastest(key) for key in keys]

    def _record_lookups(self) -> None:
        """Touch and count the lookups made since (under the lock)."""
        st, tiers, lookups = self.stats, self.tiers, self._lookups
        while lookups:
            hit, n, use, tokens = lookups.popleft()
            try:
                self.placement.touch(hit.keys, use=use)
            except Exception:  # another caller's bookkeeping must not fail this one
                log.exception("recording a lookup failed")
            st.lookups += 1
            if tokens is not None:
                st.lookup_tokens += tokens[0]
                st.hit_tokens += len(hit) * tokens[1]
            absent = n - len(hit)
            for level, tier in enumerate(tiers):
                st.hits[tier.name] += hit.levels.count(level)
                st.misses[tier.name] += absent + sum(1 for lvl in hit.levels if lvl > level)

    def contains(self, key: ChunkKey) -> bool:
        with self._section:
            return key in self.index

    def states(self, key: ChunkKey) -> dict[str, EntryState]:
        """The entry's state in each tier that has it (the remote tier as the index knows it)."""
        with self._section:
            out: dict[str, EntryState] = {}
            for level, tier in enumerate(self.tiers):
                if level == 0 and self.host.reserving(key):
                    out[tier.name] = EntryState.WRITING
                elif not self.index.holds(key, level):
                    continue
                elif self.placement.leaving(key, level):
                    out[tier.name] = EntryState.EVICTING
                elif tier.is_pinned(key):
                    out[tier.name] = EntryState.READING
                else:
                    out[tier.name] = EntryState.READABLE
            return out

    # -- reads --------------------------------------------------------------------------------
    def acquire(self, keys: Sequence[ChunkKey], *, entry: Shape | None = None, start: int = 0,
                use: int | None = None, touch: bool = True, deadline: float | None = None,
                last_entry: Shape | None = None, tenant: str | None = None) -> list[Held]:
        """Pin the longest held prefix of ``keys`` in DRAM, promoting chunks from SSD or the
        remote tier, and return where each is. The caller reads the slots, then calls
        :meth:`release` with their keys. ``entry``: the shape of these chunks (for a store of
        any model: what a chunk coming up from the remote tier will be). Shorter than the held
        prefix when DRAM cannot hold it all (what is pinned already, by anyone, stays).
        ``touch``: count this as a use of the chunks (``start``: the position of ``keys[0]``
        in its sequence; ``use``: the request). ``deadline`` (``time.monotonic()``): promote no
        more after it; what is pinned by then is returned (a daemon answers within its client's
        timeout; the client asks again for the rest). ``last_entry``: the shape of the last of
        ``keys`` when it differs (a partial chunk, stored at its own size). ``tenant``: whose
        keys these are (chunks come up from that tenant's part of the remote tier; None: the
        tenant each was found under). Raises ValueError, pinning nothing, if a key is listed
        twice: each returned entry holds one pin, which :meth:`release` of its key ends."""
        keys = list(keys)
        seen: set[ChunkKey] = set()
        for k in keys:
            if k in seen:
                raise ValueError(f"acquire: chunk {k.hex()} is listed twice; each key may be acquired "
                                 "once a call (one pin, ended by one release)")
            seen.add(k)
        out: list[Held] = []
        last = (keys[-1], last_entry) if keys and last_entry is not None else None
        with self._section, self._shaped(entry, tenant, last):
            if self.remote_level is not None:  # a run held in the remote tier: one round trip
                lost = self.placement.stats.lost
                self.placement.promote_prefix(keys, level=self.remote_level)
                self.stats.load_failures += self.placement.stats.lost - lost
            host, index = self.host, self.index
            prefix = index.longest_prefix(keys)
            early = [k for k, lvl in zip(prefix.keys, prefix.levels, strict=True) if lvl == 0 and host.pin(k)]
            pinned_early = set(early)
            try:
                for key in prefix.keys:
                    level = index.fastest(key)
                    if level is None:
                        break
                    source = self.tiers[level].name
                    if key in pinned_early:
                        pinned_early.discard(key)
                    else:
                        if level > 0 and deadline is not None and time.monotonic() > deadline:
                            break
                        if level > 0:
                            lost = self.placement.stats.lost
                            ok = self.placement.promote(key, level)
                            self.stats.load_failures += self.placement.stats.lost - lost
                            if not ok:
                                break
                        if not host.pin(key):
                            break
                    out.append(Held(key, host.slot_of(key), host.entry_bytes(key), source))  # type: ignore[arg-type]
            finally:
                for key in pinned_early:  # pinned ahead but not returned
                    host.unpin(key)
            if touch:
                self.placement.touch([h.key for h in out], start=start, use=use)
            for h in out:  # handed to a client, which reads the slot itself
                self.stats.loaded_chunks[h.source] += 1
                host.stats.hits += 1
                host.stats.bytes_read += h.nbytes
        return out

    def release(self, keys: Sequence[ChunkKey]) -> None:
        """Undo :meth:`acquire`'s pins."""
        with self._section:
            for key in keys:
                self.host.unpin(key)
            self._changed.notify_all()  # type: ignore[union-attr]  # a writer may be waiting for room

    def read(self, key: ChunkKey, read: Callable[[int, Tier], T | None], *,
             promote: bool = True, entry: Shape | None = None) -> tuple[T, int] | None:
        """``read(level, tier)`` the entry, pinned there, outside the lock, from the tier the
        placement picks (promoting it into DRAM first when ``promote``); with the level it was
        found in before promotion. A failed read is counted, that copy forgotten, and the next
        tier tried; None if none could be read."""
        while True:
            with self._section, self._shaped(entry):
                found = self.index.fastest(key)
                if found is None:
                    return None
                level = self.placement.source(key, promote)
                if level is None:
                    return None
                tier = self.tiers[level]
                held = self.mover.pin(level, key)
            got = None
            raised = True
            try:
                if held:
                    got = read(level, tier)
                raised = False
            finally:
                with self._section:
                    if held:
                        tier.unpin(key)
                    kept = False
                    if got is None and not raised:
                        self.stats.load_failures += 1
                        # a local tier that still has it failed for a reason of the machine
                        # (EMFILE, EIO): a miss now, the chunk stays; damage left the tier
                        kept = held and level != self.remote_level and tier.contains(key)
                        if not kept:
                            self._forget(key, level)
            if got is not None:
                return got, found
            if kept:
                return None

    def forget(self, key: ChunkKey) -> None:
        """Forget ``key`` in every tier (an object that cannot be completed)."""
        with self._section:
            for level in self.index.levels(key):
                self._forget(key, level)

    def _forget(self, key: ChunkKey, level: int) -> None:
        """The tier lost the entry (damage found on read): drop it from the index, and from the
        tier unless someone still reads it (the remote tier removes damaged objects itself)."""
        self.placement.forget(key, level)
        if level == self.remote_level:
            self._remote_level.forgotten(key)  # type: ignore[union-attr]
            return
        tier = self.tiers[level]
        if tier.contains(key) and not tier.is_pinned(key):
            tier.delete(key)

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
        with self._section:
            if self._closed or self._queued_prefetches >= MAX_QUEUED_PREFETCHES:
                self.stats.prefetches_dropped += 1  # a storm of hints must not queue without end
                return 0
            self._queued_prefetches += 1

        def queued() -> int:
            try:
                return work()
            finally:
                with self._section:
                    self._queued_prefetches -= 1

        self._submit(queued)
        return 0

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

    # -- writes -------------------------------------------------------------------------------
    def reserve(self, key: ChunkKey, entry: Shape, *, position: int | None = None,
                slot_bytes: int | None = None, remaining: int = 1,
                deadline: float | None = None, fmt: KVFormat | None = None,
                tenant: str = "") -> Reservation | Slot:
        """A DRAM slot for new entry ``key`` (evicting as needed; waits up to ``room_wait_s`` for
        evictions other threads run), or why there is none to write: :attr:`Slot.HELD`,
        :attr:`Slot.BUSY`. Fill ``res.buffer``, then :meth:`commit`. Raises TierFullError if
        every resident entry is pinned or the policy does not admit chunk ``position`` of its
        sequence (``remaining``: chunks of the sequence from this one on, for the counts).
        ``slot_bytes``: the slot size to take when the entry is smaller (a part of a typed
        object takes a chunk's slot). ``fmt``: what the bytes are when they are KV (a lower
        tier with a codec stores them compressed; None: stored raw everywhere). ``tenant``:
        whose chunk it is, recorded with it in every tier it goes to."""
        shape = Shape(slot_bytes, entry.segment_bytes) if slot_bytes else entry
        wait_until = time.monotonic() + self.config.room_wait_s
        deadline = wait_until if deadline is None else min(deadline, wait_until)
        with self._section, self._shaped(shape):
            state = self._slot_state(key)
            if state is not None:
                return state
            if not self.placement.admits(key, position, remaining):
                raise TierFullError(
                    f"no DRAM slot for the chunk: the {self.config.policy} policy did not admit it")
            while not self.placement.make_room(0, entry=shape):
                left = deadline - time.monotonic()
                if not (self.placement.evicting(0) or self.mover.in_flight) or left <= 0:
                    self.placement.stats.dropped += remaining
                    raise TierFullError("no DRAM slot for the chunk: every resident chunk is pinned")
                # another thread's eviction, or a move holding pins (a write-through copy),
                # will end soon: wait for it rather than refuse the chunk
                self._changed.wait(left)  # type: ignore[union-attr]
                self._record_lookups()  # those made while it waited
                state = self._slot_state(key)
                if state is not None:
                    return state
            state = self._slot_state(key)  # making room let others run
            if state is not None:
                return state
            return self.host.reserve(key, entry.nbytes, entry.segment_bytes, slot_bytes=slot_bytes, fmt=fmt,
                                     tenant=tenant)

    def _slot_state(self, key: ChunkKey) -> Slot | None:
        if key in self.index:
            return Slot.HELD
        if self.host.reserving(key):
            return Slot.BUSY
        return None

    def commit(self, res: Reservation, ok: bool = True, *, position: int | None = None) -> Future | bool:
        """Publish (or abandon) a reserved entry. Returns False if nothing was stored, else True
        or, with ``write_through`` (and an SSD tier), the Future of its copy to SSD, which the
        caller may wait for: its result is True once SSD holds the entry, False if it never got
        there (see :meth:`_write_through`; :func:`wait_all` counts those). Uploads to a
        write-through remote tier are not waited for here (the uploader reports them)."""
        with self._section:
            try:
                stored = self.host.commit(res, ok=ok)
            finally:
                self._changed.notify_all()  # type: ignore[union-attr]
            if not stored:
                return False
            self.placement.added(res.key, 0, position)
            self.stats.saved_chunks += 1
            remote = self.config.remote
            if remote is not None and remote.write == "through":
                self._remote_level.upload_from_dram(res.key, self.host, self.mover)  # type: ignore[union-attr]
            if self.config.write_through and self.disk is not None and not self._closed:
                return self._submit(lambda: self._write_through(res.key))
            return True

    def _write_through(self, key: ChunkKey) -> bool:
        """Copy committed entry ``key`` from DRAM to SSD; whether SSD holds it now (it may leave
        SSD later, evicted like any SSD chunk). An eviction of it from DRAM already running is
        waited for (its demotion is the copy). False when it never got there: DRAM dropped it
        first (evicted while SSD could not take it), SSD's policy refused it, or every try failed
        (room taken by another write meanwhile, every SSD chunk pinned, an I/O error); such a
        try is made again, ``WRITE_THROUGH_TRIES`` in all, after the next change or a short
        wait."""
        with self._section:
            placement, index = self.placement, self.index
            for attempt in range(WRITE_THROUGH_TRIES):
                deadline = time.monotonic() + WRITE_THROUGH_WAIT_S
                while placement.leaving(key, 0) and time.monotonic() < deadline:
                    self._changed.wait(WRITE_THROUGH_RETRY_S)  # type: ignore[union-attr]
                    self._record_lookups()
                if index.holds(key, 1) or not index.holds(key, 0) or placement.leaving(key, 0):
                    break
                refused = placement.stats.refused
                if placement.demote(key, 0) or placement.stats.refused != refused:
                    break  # on SSD, or its policy did not admit it (asking again would not help)
                if attempt + 1 < WRITE_THROUGH_TRIES:
                    self._changed.wait(WRITE_THROUGH_RETRY_S)  # type: ignore[union-attr]
                    self._record_lookups()
            return index.holds(key, 1)

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

    # -- introspection ------------------------------------------------------------------------
    def recorded_stats(self) -> StoreStats:
        """The counters, every lookup made so far counted."""
        with self._section:
            return self.stats

    def count(self, **deltas: int) -> None:
        """Add to the store's counters (``lookup_tokens=...``), under the lock."""
        with self._section:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def count_loaded(self, took: Iterable[tuple[str, int]], had: int = 0, failed: int = 0) -> None:
        """What an engine reports it took: ``(tier found in, tokens)`` per chunk, the tokens it
        already had, and the chunks it could not load."""
        with self._section:
            for tier, tokens in took:
                self.stats.loaded_tokens[tier] += tokens
            self.stats.had_tokens += had
            self.stats.engine_load_failures += failed

    def snapshot(self) -> dict[str, object]:
        """Capacity, use and counters per tier, and the store's own counters."""
        used = [t.used for t in self.tiers]  # (a remote tier's is a round trip: never under the lock)
        with self._section:
            s, ps = self.stats, self.placement.stats
            return {
                "tiers": {
                    t.name: {
                        "capacity_bytes": t.capacity,
                        "used_bytes": used[level],
                        "chunks": self.index.count(level),
                        "hits": s.hits[t.name],
                        "misses": s.misses[t.name],
                        "evictions": ps.evictions[level],
                        "pinned": t.pinned_count(),  # distinct entries
                        "pins": t.pin_total(),  # every pin held: more than pinned when nested
                        "reserved": t.reserved_count(),
                        "io": t.stats.as_dict(),
                    }
                    for level, t in enumerate(self.tiers)
                },
                "lookups": s.lookups,
                "lookup_tokens": s.lookup_tokens,
                "hit_tokens": s.hit_tokens,
                "loaded_tokens": dict(s.loaded_tokens),
                "loaded_chunks": dict(s.loaded_chunks),
                "had_tokens": s.had_tokens,
                "saved_chunks": s.saved_chunks,
                "dedup_chunks": s.dedup_chunks,
                "busy_chunks": s.busy_chunks,
                "dropped_chunks": s.dropped_chunks,
                "demotions": sum(ps.writes_down[1:]),
                "promotions": ps.promotions,
                "prefetched": ps.prefetched,
                "prefetches_dropped": s.prefetches_dropped,
                "prefetch_hits": ps.prefetch_hits,
                "load_failures": s.load_failures,
                "engine_load_failures": s.engine_load_failures,
                "uploads": asdict(self.uploader.stats) if self.uploader is not None else {},
            }

    def close(self) -> None:
        self._closed = True
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


def wait_all(results: Sequence[Future | bool]) -> int:
    """Wait for the futures among :meth:`ChunkCache.commit`'s results (write-through copies);
    how many of them did not reach SSD (result False, or the copy failed)."""
    missed = 0
    for r in results:
        if isinstance(r, Future):
            missed += r.result() is not True
    return missed


__all__ = ["CacheConfig", "ChunkCache", "Held", "Slot", "wait_all"]
