"""Byte movement for the store: copies between tiers, and background uploads to the remote tier.

:class:`~kvtier.core.placement.Placement` decides; :class:`TierMover` moves. Copies between local
tiers (DRAM, SSD) happen in the caller's thread under the store's lock. Copies into the remote
tier go through an :class:`Uploader`: a bounded queue and one thread, so that a save or an
eviction never waits on the network. A queued chunk becomes visible in the remote tier (and in
the store's index) only when its upload has committed.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.core.placement import Copied
from kvtier.tiers.base import (
    EntryExistsError,
    EntryPinnedError,
    Reservation,
    Tier,
    TierFullError,
    TierUnavailableError,
)
from kvtier.tiers.host import HostTier

log = logging.getLogger(__name__)

EVICT_ROUNDS = 4
EVICT_BATCH = 8
UPLOAD_BATCH = 8
"""Queued chunks the uploader writes in one ``put_many`` (one round trip) at most."""


@dataclass(slots=True)
class UploadStats:
    queued: int = 0
    uploaded: int = 0
    failed: int = 0
    """Uploads the remote tier refused or could not take (server down, full, timeout)."""
    overflow: int = 0
    """Chunks not queued because the queue was full (the remote tier is slower than saves)."""
    evicted: int = 0
    """Chunks deleted from the full remote tier to make room (oldest first)."""


@dataclass(slots=True)
class _Upload:
    key: ChunkKey
    data: torch.Tensor
    done: Callable[[bool], None]
    """Called with the outcome, under nothing; it takes the store's lock itself."""


class Uploader:
    """One thread writing queued chunks into a remote tier, in order, up to ``UPLOAD_BATCH``
    of them in one batch: one ``contains_many`` (chunks another instance already uploaded are
    not sent again) and one ``put_many``."""

    def __init__(self, tier: Tier, segment_bytes: int, max_queued: int) -> None:
        self.tier = tier
        self.segment_bytes = segment_bytes
        self.stats = UploadStats()
        self._queue: queue.Queue[_Upload | None] = queue.Queue(max_queued)
        self._pending: set[ChunkKey] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="kvtier-upload", daemon=True)
        self._thread.start()

    def pending(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._pending

    def submit(self, key: ChunkKey, data: torch.Tensor, done: Callable[[bool], None]) -> bool:
        """Queue an upload; False (and ``done`` is not called) if already queued or full."""
        with self._lock:
            if key in self._pending:
                return False
            try:
                self._queue.put_nowait(_Upload(key, data, done))
            except queue.Full:
                self.stats.overflow += 1
                return False
            self._pending.add(key)
            self.stats.queued += 1
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload has finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def _run(self) -> None:
        stop = False
        while not stop and (item := self._queue.get()) is not None:
            batch = [item]
            while len(batch) < UPLOAD_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                outcomes = self._put_batch(batch)
            except Exception:  # never let one batch kill the thread
                log.exception("upload of %d chunks to the remote tier failed", len(batch))
                outcomes = [False] * len(batch)
            for item, ok in zip(batch, outcomes, strict=True):
                self._finish(item, ok)

    def _finish(self, item: _Upload, ok: bool) -> None:
        with self._lock:
            if ok:
                self.stats.uploaded += 1
            else:
                self.stats.failed += 1
        try:
            item.done(ok)
        except Exception:
            log.exception("after the upload of chunk %s", item.key.hex())
        finally:
            with self._idle:
                self._pending.discard(item.key)
                self._idle.notify_all()

    def _put_batch(self, batch: list[_Upload]) -> list[bool]:
        """Upload a batch; per chunk whether the remote tier holds it now. A chunk the full
        tier refused goes through :meth:`_put`, which makes room."""
        tier = self.tier
        held = tier.contains_many([item.key for item in batch])
        todo = [i for i, h in enumerate(held) if not h]
        outcomes = list(held)
        if not todo:
            return outcomes
        results = tier.put_many([batch[i].key for i in todo], [batch[i].data for i in todo], self.segment_bytes)
        for i, result in zip(todo, results, strict=True):
            if isinstance(result, EntryExistsError):  # being written by another instance right now
                log.info("remote tier did not take chunk %s: %s", batch[i].key.hex(), result)
            full = isinstance(result, TierFullError) and not isinstance(result, TierUnavailableError)
            outcomes[i] = self._put(batch[i]) if full else result is True
        return outcomes

    def _put(self, item: _Upload) -> bool:
        """Upload one chunk the full remote tier refused: it gives up its oldest chunks (first
        written, first out, whoever wrote them: it is shared) to make room, a few at a time."""
        tier = self.tier
        for _ in range(EVICT_ROUNDS):
            if tier.contains(item.key):
                return True
            try:
                return tier.put(item.key, item.data, self.segment_bytes)
            except ValueError as exc:  # being written by another instance right now
                log.info("remote tier did not take chunk %s: %s", item.key.hex(), exc)
                return False
            except TierUnavailableError:  # evicting would not help (nor work)
                return False
            except TierFullError:
                oldest = tier.keys()[:EVICT_BATCH]
                if not oldest:
                    return False
                for key in oldest:
                    with contextlib.suppress(EntryPinnedError):
                        tier.delete(key)
                self.stats.evicted += len(oldest)
        return False

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


class TierMover:
    """Moves chunk bytes between the store's tiers for its Placement. The remote tier, if
    any, is the last level and is written only through ``uploader``."""

    def __init__(self, tiers: Sequence[Tier], host: HostTier, layout: KVLayout,
                 uploader: Uploader | None = None,
                 uploaded: Callable[[ChunkKey, bool], None] | None = None) -> None:
        self.tiers = tiers
        self.host = host
        self.layout = layout
        self.uploader = uploader
        self.remote_level = len(tiers) - 1 if uploader is not None else None
        self._uploaded = uploaded

    def has_room(self, level: int, count: int = 1) -> bool:
        if level == self.remote_level:
            return True  # the uploader makes room in the shared tier (it may be full only later)
        tier = self.tiers[level]
        return tier.free >= count * tier.footprint(self.layout.chunk_bytes, self.layout.layer_bytes)

    def fits(self, level: int, count: int) -> bool:
        tier = self.tiers[level]
        return count * tier.footprint(self.layout.chunk_bytes, self.layout.layer_bytes) <= tier.capacity

    def is_pinned(self, level: int, key: ChunkKey) -> bool:
        return self.tiers[level].is_pinned(key)

    def pin_many(self, level: int, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.tiers[level].pin_many(keys)

    def pin(self, level: int, key: ChunkKey) -> bool:
        return self.tiers[level].pin(key)

    def unpin(self, level: int, key: ChunkKey) -> None:
        self.tiers[level].unpin(key)

    def copy(self, key: ChunkKey, src: int, dst: int) -> Copied:
        """The DRAM slot is handed to a lower tier as it lies (zero-copy for the SSD tier); a
        chunk read from a lower tier lands straight in the destination's reservation; a chunk
        for the remote tier is copied out and queued for upload."""
        source, target = self.tiers[src], self.tiers[dst]
        if dst == self.remote_level:
            data = self.host.view(key).clone() if src == 0 else source.get(key)
            if data is None:
                return Copied.SOURCE_LOST
            return Copied.QUEUED if self.upload(key, data) else Copied.FAILED
        try:
            if src == 0:
                stored = target.put(key, self.host.view(key), self.layout.layer_bytes)
                return Copied.OK if stored else Copied.FAILED
            res = target.reserve(key, source.entry_bytes(key) or 0, self.layout.layer_bytes)
        except (TierFullError, ValueError) as exc:
            log.warning("copying chunk %s from %s to %s failed: %s", key.hex(), source.name,
                        target.name, exc)
            return Copied.FAILED
        late: list[Future] = []
        try:
            ok = source.get_into(key, res.buffer, late.append)
        except BaseException:
            target.commit(res, ok=False)
            raise
        if late:  # a read given up on may still write the reservation: it is abandoned after
            self._release_all(late, target, [res])
            return Copied.SOURCE_LOST
        stored = target.commit(res, ok=ok)
        if not ok:
            return Copied.SOURCE_LOST
        return Copied.OK if stored else Copied.FAILED

    def copy_many(self, keys: Sequence[ChunkKey], src: int, dst: int) -> list[Copied]:
        """:meth:`copy` of each key; chunks read from a lower tier are read with one
        ``get_many_into`` (one round trip to the remote tier) straight into the destination's
        reservations, which are sized for the store's chunks."""
        if len(keys) < 2 or src == 0 or dst == self.remote_level:
            return [self.copy(key, src, dst) for key in keys]
        source, target = self.tiers[src], self.tiers[dst]
        results = [Copied.FAILED] * len(keys)
        held: list[tuple[int, Reservation]] = []
        for i, key in enumerate(keys):
            try:
                held.append((i, target.reserve(key, self.layout.chunk_bytes, self.layout.layer_bytes)))
            except (TierFullError, ValueError) as exc:
                log.warning("copying chunk %s from %s to %s failed: %s", key.hex(), source.name,
                            target.name, exc)
        late: list[Future] = []
        try:
            oks = source.get_many_into([keys[i] for i, _ in held], [res.buffer for _, res in held], late.append)
        except BaseException as exc:  # ValueError: an entry of another size
            self._release_all(late, target, [res for _, res in held])
            if not isinstance(exc, ValueError):
                raise
            if late:  # the source is down: nothing to retry now
                return results
            reserved = {i for i, _ in held}  # one by one, each sized by its source
            return [self.copy(key, src, dst) if i in reserved else Copied.FAILED for i, key in enumerate(keys)]
        # reads given up on may still write the unread reservations: released once they end
        self._release_all(late, target, [res for (_, res), ok in zip(held, oks, strict=True) if not ok])
        for (i, res), ok in zip(held, oks, strict=True):
            results[i] = (Copied.OK if target.commit(res, ok=True) else Copied.FAILED) if ok else Copied.SOURCE_LOST
        return results

    def _release_all(self, late: list[Future], target: Tier, reservations: list[Reservation]) -> None:
        """Release ``reservations`` now, or, when reads given up on (``late``) may still write
        them, once every one of those calls has ended."""
        if not late:
            for res in reservations:
                target.commit(res, ok=False)
            return
        lock, left = threading.Lock(), [len(late)]

        def ended(_: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                for res in reservations:
                    self._abandon(target, res)

        for future in late:
            future.add_done_callback(ended)

    @staticmethod
    def _abandon(target: Tier, res: Reservation) -> None:
        try:
            target.commit(res, ok=False)
        except ValueError:  # the tier was closed meanwhile: nothing left to release
            log.debug("late abandon of chunk %s: %s already closed", res.key.hex(), target.name)

    def upload(self, key: ChunkKey, data: torch.Tensor,
               after: Callable[[], None] | None = None) -> bool:
        """Queue ``data`` for the remote tier; ``after`` runs once the upload is over."""
        assert self.uploader is not None
        notify = self._uploaded

        def done(ok: bool) -> None:
            if after is not None:
                after()
            if notify is not None:
                notify(key, ok)

        return self.uploader.submit(key, data, done)

    def drop(self, key: ChunkKey, level: int) -> None:
        self.tiers[level].delete(key)
