"""Byte movement for the store: the live mover (transfer handlers per pair of tiers are in
:mod:`kvtier.store.transfers`, its reads up into DRAM in :mod:`kvtier.store.promotions`).

:class:`~kvtier.core.placement.Placement` decides, under the store's lock, and hands each decision
to the store's :class:`TierMover` as a :class:`~kvtier.core.mover.Move`. The mover takes what
must be taken atomically with the decision -- the destination's reservation, made while the lock
is still held -- then **releases the store's lock** and gives the byte copy to the
:class:`~kvtier.store.transfers.Handler` registered for the move's (source tier, destination tier) pair, which runs it
on its own threads; when it is done the mover takes the lock again and reports the outcome.
Other clients' lookups, loads and saves go on meanwhile: no tier I/O, no network round trip and
no bulk memory copy happens under the lock.

Entry states while the lock is released, and what protects them:

- *being written*: a destination reservation is invisible to lookups, and a second writer of
  the same key is refused (``EntryExistsError``); a promotion that finds its key being written
  by someone else waits for that write and reports :attr:`Copied.PRESENT`;
- *being read*: the source is pinned by the placement, so nothing deletes it;
- *being evicted*: a victim is marked leaving by the placement, skipped by other evictions, and
  dropped after its demotion only if nobody pinned it meanwhile.

Moves into the remote tier go through the :class:`~kvtier.store.uploader.Uploader` (a queue and its
thread): the handler for (DRAM or SSD, remote) only copies the bytes out for it.

Tenants: every entry records whose chunk it is (DRAM slot, SSD header, remote object), and a
move carries it along -- a demotion writes the DRAM entry's tenant into the SSD file, an upload
goes to the tenant's prefix of the remote tier, a promotion gives the DRAM slot the tenant of
the copy it came from. No move asks a map held in memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Copied, Move, Shape
from kvtier.store.promotions import Promotions
from kvtier.store.transfers import HANDLER_THREADS, Handler, Transfers
from kvtier.store.uploader import Uploader
from kvtier.tiers.base import Tier, TierFullError
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

log = logging.getLogger(__name__)


class TierMover(Promotions):
    """The store's :class:`~kvtier.core.mover.Mover`: moves chunk bytes between its tiers.

    ``lock`` is the store's lock, held by whoever calls the mover (the placement); the mover
    releases it while bytes move. Without one (a mover used on its own, in tests) nothing is
    released. ``chunk``: the ``(nbytes, segment_bytes)`` of an entry when the caller does not
    say (:meth:`shape`); ``position_of``: a chunk's index in its sequence (recorded on SSD).
    """

    def __init__(self, tiers: Sequence[Tier], host: HostTier, chunk: Shape | None,
                 uploader: Uploader | None = None,
                 uploaded: Callable[[ChunkKey, bool, str], None] | None = None,
                 lock: threading.Lock | None = None,
                 position_of: Callable[[ChunkKey], int | None] | None = None,
                 tenant_of: Callable[[ChunkKey], str] | None = None) -> None:
        self.tiers = list(tiers)
        self.host = host
        self.chunk = chunk
        self.uploader = uploader
        self.remote_level = len(tiers) - 1 if uploader is not None else None
        self._uploaded = uploaded
        self._tenant_of = tenant_of or (lambda key: self.current_tenant() or "")
        """Whose chunk ``key`` is, for one coming up from the remote tier (the request's tenant
        being served on this thread, else the tenant it was found under)."""
        self._lock = lock
        self.changed = threading.Condition(lock) if lock is not None else None
        """Notified whenever a reservation ends (committed or abandoned) under the lock."""
        self._position_of = position_of or (lambda key: None)
        self.transfers = Transfers()
        names = [t.name for t in tiers]
        for src in names:
            for dst in names:
                if src != dst and (src, dst) in HANDLER_THREADS:
                    self.transfers.register(src, dst)
        self._local = threading.local()
        self.in_flight = 0
        """Copies out of DRAM running now with the lock released, and uploads holding DRAM pins
        (under the lock)."""
        self.on_relock: Callable[[], None] | None = None
        """Called whenever the lock is taken back after a body ran without it (the cache records
        the lookups made meanwhile, so their touches come before the next eviction)."""
        self._drains: dict[ChunkKey, int] = {}  # first key of a group being evicted -> its region

    # -- the caller's lock --------------------------------------------------------------------
    @contextlib.contextmanager
    def unlocked(self, frees_dram: bool = False) -> Iterator[None]:
        """Release the store's lock for the body (the caller holds it). ``frees_dram``: the body
        is a copy out of DRAM whose pin ends with it (a demotion, a write-through, an upload):
        counted in :attr:`in_flight`, for a writer waiting for room."""
        if self._lock is None:
            yield
            return
        self.in_flight += frees_dram
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            if frees_dram:
                self.in_flight -= 1
            # whatever ran unlocked may have freed room (a pin ended, an eviction dropped an
            # entry): a waiting writer looks again
            self.notify()
            if self.on_relock is not None:
                self.on_relock()

    def notify(self) -> None:
        """Wake whoever waits for a reservation to end (call under the lock)."""
        if self.changed is not None:
            self.changed.notify_all()

    # -- entry shapes -------------------------------------------------------------------------
    @contextlib.contextmanager
    def shaped(self, entry: Shape | None, tenant: str | None = None,
               last: tuple[ChunkKey, Shape] | None = None) -> Iterator[None]:
        """Chunks this thread moves in the body whose shape no tier knows yet (coming up from
        the remote tier) are ``entry`` (a daemon's client says what its chunks are; ``last``:
        one key of another shape, a partial chunk), and are ``tenant``'s (the request's: its
        keys are bound to it)."""
        old = (getattr(self._local, "shape", None), getattr(self._local, "tenant", None),
               getattr(self._local, "last", None))
        self._local.shape, self._local.tenant, self._local.last = entry, tenant, last
        try:
            yield
        finally:
            self._local.shape, self._local.tenant, self._local.last = old

    def shape(self, key: ChunkKey | None = None) -> Shape | None:
        last = getattr(self._local, "last", None)
        if key is not None and last is not None and last[0] == key:
            return last[1]
        return getattr(self._local, "shape", None) or self.chunk

    def current_tenant(self) -> str | None:
        """The tenant of the request this thread is serving (None: none, background work)."""
        return getattr(self._local, "tenant", None)

    def entry_of(self, level: int, key: ChunkKey) -> Shape | None:
        if level == 0:
            n, seg = self.host.entry_bytes(key), self.host.segment_of(key)
            return Shape(n, seg) if n is not None and seg is not None else None
        tier = self.tiers[level]
        if isinstance(tier, DiskTier):
            n, seg = tier.entry_bytes(key), tier.segment_bytes_of(key)
            return Shape(n, seg) if n is not None and seg is not None else None
        return self.shape(key)  # the remote tier: asking would be a round trip under the lock

    def _entry(self, entry: Shape | None) -> Shape | None:
        return entry if entry is not None else self.shape()

    # -- room ---------------------------------------------------------------------------------
    def has_room(self, level: int, count: int = 1, entry: Shape | None = None) -> bool:
        if level == self.remote_level:
            return True  # the uploader makes room in the shared tier (it may be full only later)
        shape = self._entry(entry)
        if shape is None:
            raise ValueError("the size of the entry to make room for is not known")
        if level == 0:
            return self.host.has_room(shape.nbytes, count)
        tier = self.tiers[level]
        return tier.free >= count * tier.footprint(shape.nbytes, shape.segment_bytes)

    def fits(self, level: int, count: int, entry: Shape | None = None) -> bool:
        shape = self._entry(entry)
        if shape is None:
            return False
        if level == 0:
            return self.host.fits(shape.nbytes, count)
        tier = self.tiers[level]
        return count * tier.footprint(shape.nbytes, shape.segment_bytes) <= tier.capacity

    def evictable(self, level: int, key: ChunkKey, entry: Shape | None = None) -> bool:
        tier = self.tiers[level]
        if tier.is_pinned(key):
            return False
        if level != 0 or self.host.slot_stride:
            return True
        shape = self._entry(entry)
        if shape is None or self.host.region_serves(key, shape.nbytes):
            return True
        region = self.host.region_of(key)  # another size: only a whole extent can make room
        return region is not None and not self.host.region_busy(region)

    def evict_group(self, level: int, key: ChunkKey, entry: Shape | None = None) -> list[ChunkKey]:
        shape = self._entry(entry)
        if level != 0 or self.host.slot_stride or shape is None or self.host.region_serves(key, shape.nbytes):
            return [key]
        region = self.host.region_of(key)
        if region is None:
            return [key]
        group = self.host.region_keys(region)
        if group:
            self.host.drain(region)  # its slots are not handed out while it empties
            self._drains[group[0]] = region
        return group or [key]

    def group_done(self, level: int, group: Sequence[ChunkKey]) -> None:
        if level != 0 or not group:
            return  # only DRAM regions drain (an SSD group is one chunk)
        region = self._drains.pop(group[0], None)
        if region is not None:
            self.host.drain(region, on=False)

    # -- pins ---------------------------------------------------------------------------------
    def is_pinned(self, level: int, key: ChunkKey) -> bool:
        return self.tiers[level].is_pinned(key)

    def pin_many(self, level: int, keys: Sequence[ChunkKey]) -> list[bool]:
        if level == self.remote_level:
            with self.unlocked():  # a remote tier asks its server
                return self.tiers[level].pin_many(keys)
        return self.tiers[level].pin_many(keys)

    def pin(self, level: int, key: ChunkKey) -> bool:
        if level == self.remote_level:
            return self.pin_many(level, [key])[0]
        return self.tiers[level].pin(key)

    def unpin(self, level: int, key: ChunkKey) -> None:
        self.tiers[level].unpin(key)

    def drop(self, key: ChunkKey, level: int) -> None:
        self.tiers[level].delete(key)  # DRAM: a free list; SSD: the unlink runs in the background

    # -- moves --------------------------------------------------------------------------------
    def _handler(self, src: int, dst: int) -> Handler:
        return self.transfers.get(self.tiers[src].name, self.tiers[dst].name)

    def copy(self, move: Move) -> Copied:
        """The DRAM slot is handed to a lower tier as it lies (zero-copy for the SSD tier); a
        chunk read from a lower tier lands straight in the destination's reservation; a chunk
        for the remote tier is copied out and queued for upload."""
        if move.dst == self.remote_level:
            return self._upload(move)
        if move.src == 0:
            return self._write_down(move)
        return self._read_up(move)

    def _write_down(self, move: Move) -> Copied:
        key, target = move.key, self.tiers[move.dst]
        view = self.host.view(key)  # pinned by the placement for the move
        seg = self.host.segment_of(key)
        fmt = self.host.format_of(key)
        tenant = self.host.tenant_of(key) or ""
        position = self._position_of(key)
        try:
            with self.unlocked(frees_dram=True):
                if isinstance(target, DiskTier):
                    target.wait_deleted(key)  # an old copy of the key still being unlinked
                    stored = self._handler(move.src, move.dst).run(target.put, key, view, seg,
                                                                   position=position, fmt=fmt, tenant=tenant)
                else:
                    stored = self._handler(move.src, move.dst).run(target.put, key, view, seg, fmt=fmt)
        except (TierFullError, ValueError) as exc:  # room taken meanwhile; being written by another
            log.info("copying chunk %s from host to %s failed: %s", key.hex(), target.name, exc)
            return Copied.FAILED
        return Copied.OK if stored else Copied.FAILED

    def _upload(self, move: Move) -> Copied:
        key, source = move.key, self.tiers[move.src]
        shape = self.entry_of(move.src, key)
        seg = shape.segment_bytes if shape is not None else None
        fmt = self.host.format_of(key) if move.src == 0 else source.format_of(key)
        tenant = (self.host.tenant_of(key) if move.src == 0 else
                  source.tenant_of(key) if isinstance(source, DiskTier) else None) or ""
        if move.src == 0:
            view = self.host.view(key)
            with self.unlocked(frees_dram=True):
                data: torch.Tensor | None = view.clone()
        else:
            with self.unlocked():
                data = self._handler(move.src, move.dst).run(source.get, key)
        if data is None:
            return Copied.SOURCE_LOST
        return Copied.QUEUED if self.upload(key, data, seg=seg, fmt=fmt, tenant=tenant) else Copied.FAILED

    def upload(self, key: ChunkKey, data: torch.Tensor, after: Callable[[], None] | None = None,
               seg: int | None = None, fmt: KVFormat | None = None, tenant: str = "") -> bool:
        """Queue ``data``, ``tenant``'s chunk, for the remote tier (that tenant's prefix where
        tenants are kept apart); ``after`` runs once the upload is over."""
        assert self.uploader is not None
        notify = self._uploaded

        def done(ok: bool) -> None:
            if after is not None:
                after()
            if notify is not None:
                notify(key, ok, tenant)

        return self.uploader.submit(key, data, done, seg, fmt, tenant=tenant)

    def close(self) -> None:
        self.transfers.close()
