"""Background uploads into the remote tier: a bounded queue and one thread.

A save or an eviction never waits on the network: it queues the chunk's bytes here and goes on.
A queued chunk becomes visible in the remote tier (and in the store's index, through the
``done`` callback) only once its upload has committed. The uploader is the store's transfer
handler for every move into the remote tier (:mod:`kvtier.store.moves`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import (
    EntryExistsError,
    EntryPinnedError,
    Tier,
    TierFullError,
    TierUnavailableError,
)
from kvtier.tiers.codec_types import KVFormat

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
    segment_bytes: int
    """The entry's independently checksummed part (a layer of a chunk)."""
    fmt: KVFormat | None = None
    """What the bytes are when they are KV (a remote tier with a codec compresses them)."""
    tenant: str = ""
    """Whose chunk it is: a remote tier that keeps tenants apart stores it under theirs."""


class Uploader:
    """One thread writing queued chunks into a remote tier, in order, up to ``UPLOAD_BATCH``
    of them in one batch: one ``contains_many`` (chunks another instance already uploaded are
    not sent again) and one ``put_many``."""

    def __init__(self, tier: Tier, segment_bytes: int | None, max_queued: int) -> None:
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

    def submit(self, key: ChunkKey, data: torch.Tensor, done: Callable[[bool], None],
               segment_bytes: int | None = None, fmt: KVFormat | None = None, tenant: str = "") -> bool:
        """Queue an upload; False (and ``done`` is not called) if already queued or full.
        ``segment_bytes``: the entry's checksummed part (default: the uploader's, else whole);
        ``fmt``: what the bytes are, when they are KV."""
        seg = segment_bytes or self.segment_bytes or int(data.numel())
        with self._lock:
            if key in self._pending:
                return False
            try:
                self._queue.put_nowait(_Upload(key, data, done, seg, fmt, tenant))
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

    def _tier_for(self, tenant: str) -> Tier:
        """The tier ``tenant``'s chunks go to (its own prefix where the tier keeps tenants
        apart: the chunk's recorded tenant decides, never a map held in memory)."""
        for_tenant = getattr(self.tier, "for_tenant", None)
        return for_tenant(tenant) if for_tenant is not None else self.tier

    def _put_batch(self, batch: list[_Upload]) -> list[bool]:
        """Upload a batch; per chunk whether the remote tier holds it now. A chunk the full
        tier refused goes through :meth:`_put`, which makes room."""
        outcomes = [False] * len(batch)
        by_tenant: dict[str, list[int]] = {}
        for i, item in enumerate(batch):
            by_tenant.setdefault(item.tenant, []).append(i)
        results = {}
        for tenant, members in by_tenant.items():
            tier = self._tier_for(tenant)
            held = tier.contains_many([batch[i].key for i in members])
            todo = [i for i, h in zip(members, held, strict=True) if not h]
            for i, h in zip(members, held, strict=True):
                outcomes[i] = h
            groups: dict[int, list[int]] = {}  # one put_many per segment size (a daemon's models)
            for i in todo:
                groups.setdefault(batch[i].segment_bytes, []).append(i)
            for seg, idx in groups.items():
                got = tier.put_many([batch[i].key for i in idx], [batch[i].data for i in idx], seg,
                                    fmts=[batch[i].fmt for i in idx])
                results.update(zip(idx, got, strict=True))
        for i, result in results.items():
            if isinstance(result, EntryExistsError):  # being written by another instance right now
                log.info("remote tier did not take chunk %s: %s", batch[i].key.hex(), result)
            full = isinstance(result, TierFullError) and not isinstance(result, TierUnavailableError)
            outcomes[i] = self._put(batch[i]) if full else result is True
        return outcomes

    def _put(self, item: _Upload) -> bool:
        """Upload one chunk the full remote tier refused: it gives up its oldest chunks (first
        written, first out, whoever wrote them: it is shared) to make room, a few at a time --
        found with one bounded query (``oldest``), never by reading the whole index."""
        tier = self._tier_for(item.tenant)
        for _ in range(EVICT_ROUNDS):
            if tier.contains(item.key):
                return True
            try:
                return tier.put(item.key, item.data, item.segment_bytes, fmt=item.fmt)
            except ValueError as exc:  # being written by another instance right now
                log.info("remote tier did not take chunk %s: %s", item.key.hex(), exc)
                return False
            except TierUnavailableError:  # evicting would not help (nor work)
                return False
            except TierFullError:
                oldest = tier.oldest(EVICT_BATCH)
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
