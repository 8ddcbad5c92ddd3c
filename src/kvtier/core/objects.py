"""Typed objects beside KV chunks: encoder outputs, vector-index shards, other blobs.

An object is content-addressed like a chunk: its key is an XXH3-128 hash over its kind and the
parts that determine its bytes (an image's content hash and the encoder's fingerprint; a corpus
or user id and an index version), plus the tenant salt. The store keeps an object as a short
*sequence of parts*, each at most one DRAM slot, so every kind passes through the same tiers,
checksums, stats and policies as KV: part ``i`` has key ``part_key(key, i)`` and, like a chunk of
a conversation, is worth nothing without the parts before it (policies evict the last parts
first). Part 0 starts with an :class:`ObjectHeader` (size, kind, declared recompute time).

Each kind reports what a miss costs: ``recompute_s``, the seconds to rebuild the object (run the
vision encoder again, rebuild or re-read the index), measured on the machine or declared by the
caller. The ``cost`` policy ranks every part by that time per byte, against KV chunks' prefill
time per byte, in one budget.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from kvtier.core.keys import ChunkKey


class ObjectKind(enum.IntEnum):
    KV = 0
    ENCODER_OUTPUT = 1
    """A multimodal encoder's output for one input (image bytes), for one encoder."""
    INDEX_SHARD = 2
    """A serialized vector index (FAISS, usearch...) of a corpus or a user, at a version."""
    BLOB = 3
    """Anything else with a declared recompute cost."""


_HEADER = struct.Struct("<4sHHQd")
HEADER_BYTES = _HEADER.size
_MAGIC = b"KVOB"


def object_key(kind: ObjectKind, *parts: str | bytes, tenant: str = "") -> ChunkKey:
    """The key of an object of ``kind`` identified by ``parts`` (length-prefixed, so
    ``("ab", "c")`` and ``("a", "bc")`` differ)."""
    if not parts:
        raise ValueError("an object key needs at least one identifying part")
    h = xxhash.xxh3_128(b"kvtier-obj-v1")
    h.update(int(kind).to_bytes(2, "little"))
    for part in (tenant, *parts):
        raw = part.encode() if isinstance(part, str) else bytes(part)
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return ChunkKey(h.digest())


def content_hash(data: bytes | memoryview) -> str:
    """Hex XXH3-128 of raw content (an image file's bytes)."""
    return xxhash.xxh3_128_hexdigest(data)


def part_key(key: ChunkKey, index: int) -> ChunkKey:
    """Key of part ``index`` of object ``key`` (part 0 is the object key itself)."""
    if index == 0:
        return key
    return ChunkKey(xxhash.xxh3_128_digest(key + index.to_bytes(4, "little")))


def part_keys(key: ChunkKey, nbytes: int, part_bytes: int) -> list[ChunkKey]:
    """Keys of the parts of an object of ``nbytes`` payload bytes (header included)."""
    count = max(1, -(-(nbytes + HEADER_BYTES) // part_bytes))
    return [part_key(key, i) for i in range(count)]


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    kind: ObjectKind
    nbytes: int
    """Payload bytes (the header excluded)."""
    recompute_s: float

    def encode(self) -> bytes:
        return _HEADER.pack(_MAGIC, 1, int(self.kind), self.nbytes, self.recompute_s)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ObjectHeader | None:
        """None if ``raw`` does not start with a valid header."""
        if len(raw) < HEADER_BYTES:
            return None
        magic, version, kind, nbytes, recompute_s = _HEADER.unpack_from(raw)
        if magic != _MAGIC or version != 1 or kind not in ObjectKind._value2member_map_:
            return None
        return cls(ObjectKind(kind), nbytes, recompute_s)

