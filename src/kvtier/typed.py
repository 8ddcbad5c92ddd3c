"""Typed objects in the store's tiers: encoder outputs, vector-index shards, blobs.

    objects = TypedObjects(store)
    key = object_key(ObjectKind.ENCODER_OUTPUT, content_hash(image_bytes), encoder_fingerprint)
    objects.put(key, data, ObjectKind.ENCODER_OUTPUT, recompute_s=0.08)
    hit = objects.get(key)                  # bytes back (or None), and the slowest tier read

An object is stored as a sequence of parts of at most one DRAM slot (see
:mod:`kvtier.core.objects`), so it goes through the same DRAM, SSD and remote tiers, checksums,
placement and policy as KV chunks, in the same budget. Every part of an object is touched with
its share of the object's ``recompute_s``, which is what the ``cost`` policy weighs against the
prefill time that KV chunks save. An object is either read whole or missed: a missing or damaged
part is a miss (counted; the damaged copy is dropped), never a partial or wrong object.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.core.objects import HEADER_BYTES, ObjectHeader, ObjectKind, part_key, part_keys
from kvtier.store import KVStore
from kvtier.store.cache import Slot
from kvtier.tiers.base import Reservation, TierFullError, as_byte_tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ObjectHit:
    data: torch.Tensor
    """The object's bytes (``uint8``, a copy)."""
    header: ObjectHeader
    tier: str
    """The slowest tier a part was read from."""


@dataclass(slots=True)
class ObjectStats:
    puts: Counter[str] = field(default_factory=Counter)
    hits: Counter[str] = field(default_factory=Counter)
    misses: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    """Objects that found no room (or were not admitted) in DRAM, per kind."""
    bytes_read: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        return {"puts": dict(self.puts), "hits": dict(self.hits), "misses": self.misses,
                "refused": dict(self.refused), "bytes_read": dict(self.bytes_read)}


class TypedObjects:
    """Put and get typed objects through a :class:`~kvtier.store.KVStore`'s tiers."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.part_bytes = store.layout.chunk_bytes
        self.stats = ObjectStats()
        self._lock = threading.Lock()

    def put(self, key: ChunkKey, data: object, kind: ObjectKind, recompute_s: float) -> bool:
        """Store an object (a no-op if it is already held). False if DRAM could not take it
        (not admitted, or everything pinned): the caller just rebuilds it next time."""
        if not isinstance(kind, ObjectKind) or kind is ObjectKind.KV:
            raise ValueError(f"kind must be a non-KV ObjectKind, got {kind!r}")
        if not recompute_s >= 0:
            raise ValueError(f"recompute_s must be >= 0 seconds, got {recompute_s!r}")
        payload = as_byte_tensor(data)
        header = ObjectHeader(kind, int(payload.numel()), float(recompute_s)).encode()
        blob = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8), payload])
        keys = part_keys(key, payload.numel(), self.part_bytes)
        store, step = self.store, self.part_bytes
        if len(keys) * store.host.stride_for(step) > store.host.capacity:
            raise ValueError(
                f"an object of {payload.numel()} bytes ({len(keys)} parts of {step}) does not fit "
                f"in the DRAM tier of {store.host.capacity} bytes"
            )
        cache = store.cache
        pinned: list[ChunkKey] = []
        written: list[ChunkKey] = []
        complete = False
        try:  # parts written stay pinned until all are: making room must not take them
            for i, pk in enumerate(keys):
                part = blob[i * step : (i + 1) * step]
                n = int(part.numel())
                try:
                    res = cache.reserve(pk, Shape(n, min(n, store.layout.layer_bytes)), position=i,
                                        slot_bytes=step, remaining=len(keys) - i)
                except TierFullError:
                    break
                if res is Slot.BUSY:  # another writer is storing this very object now
                    break
                if isinstance(res, Reservation):
                    res.buffer.copy_(part)
                    if cache.commit(res, position=i):
                        written.append(pk)
                if cache.pin_dram(pk):
                    pinned.append(pk)
            else:
                complete = True
        finally:
            for pk in pinned:
                cache.unpin_dram(pk)
        if not complete:
            self._drop_parts(written)  # a partial object is worth nothing
            with self._lock:
                self.stats.refused[kind.name] += 1
            return False
        cache.touch(keys, recompute_s / len(keys))
        with self._lock:
            self.stats.puts[kind.name] += 1
        return True

    def get(self, key: ChunkKey, promote: bool = True) -> ObjectHit | None:
        """The whole object, or None. Parts read from below DRAM are promoted into DRAM."""
        store = self.store
        first = store.read_entry(key, promote)
        header = ObjectHeader.decode(first[0].numpy()) if first is not None else None
        if first is None or header is None:
            if first is not None:
                log.warning("object %s: part 0 has no valid header; dropped", key.hex())
                self._drop_parts([key])
            return self._missed()
        keys = part_keys(key, header.nbytes, self.part_bytes)
        parts, tiers = [first[0]], [first[1]]
        for pk in keys[1:]:
            got = store.read_entry(pk, promote)
            if got is None:
                return self._missed()
            parts.append(got[0])
            tiers.append(got[1])
        blob = torch.cat(parts) if len(parts) > 1 else parts[0]
        if blob.numel() != HEADER_BYTES + header.nbytes:
            log.warning("object %s: parts hold %d bytes, the header says %d; dropped",
                        key.hex(), blob.numel() - HEADER_BYTES, header.nbytes)
            self._drop_parts(keys)
            return self._missed()
        store.cache.touch(keys, header.recompute_s / len(keys))
        names = store.tier_names
        slowest = max(tiers, key=names.index)
        with self._lock:
            self.stats.hits[header.kind.name] += 1
            self.stats.bytes_read[header.kind.name] += header.nbytes
        return ObjectHit(blob[HEADER_BYTES:], header, slowest)

    def contains(self, key: ChunkKey) -> bool:
        """Whether part 0 is held somewhere (the object may still turn out incomplete)."""
        return self.store.cache.contains(key)

    def _missed(self) -> None:
        with self._lock:
            self.stats.misses += 1

    def _drop_parts(self, keys: list[ChunkKey]) -> None:
        """Forget the parts of an object that cannot be completed, in every tier."""
        for pk in keys:
            self.store.cache.forget(pk)


__all__ = ["ObjectHit", "ObjectKind", "TypedObjects", "part_key"]
