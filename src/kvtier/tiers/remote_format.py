"""The object format of the remote tiers (:mod:`kvtier.tiers.remote`): a checksummed header,
then the payload; writing and checking a header (:class:`ObjectHeader`).

Object format (all integers little-endian)::

    header
        magic "KVTR", version u16, flags u16, header_len u32, key 16B,
        payload_len u64, segment_bytes u64, n_segments u32,
        n_segments x u64 XXH3-64 checksums (one per segment, i.e. per layer of a chunk),
        u64 XXH3-64 of all the header bytes before it
    payload (payload_len bytes)

Version 2 (written for chunks stored through a codec, :mod:`kvtier.tiers.coded`) keeps the
codec's id in ``flags`` and adds raw_nbytes u64 and raw_segment_bytes u64 after n_segments; its
payload is the codec's frames, one segment each, and the checksums are over those stored bytes.
Raw chunks are written as version 1, byte for byte as before. Callers see raw bytes only:
offsets, lengths and ``entry_bytes`` are in raw bytes, a layer read decodes one frame, and a
tier decodes whatever codec a header names, whatever its own is.

The key is inside the header so that bytes of another chunk (an object rewritten or moved under
a reader) fail verification instead of passing as this chunk.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.errors import KVTierError
from kvtier.tiers.codec_types import CODEC_NAMES
from kvtier.tiers.coded import Coding

MAGIC = b"KVTR"
VERSION = 1
"""Raw chunks."""
VERSION_CODED = 2
"""Chunks stored through a codec."""
_FIXED = struct.Struct(f"<4sHHI{KEY_BYTES}sQQI")
_CODED = struct.Struct("<QQ")  # raw_nbytes, raw_segment_bytes: version 2 only
FIXED_BYTES = _FIXED.size
"""Bytes to read from the start of an object to learn its header length."""


class CorruptObject(KVTierError, ValueError):
    """An object's bytes fail the header or checksum checks."""


class UnknownFormat(CorruptObject):
    """An object in a format this version of kvtier does not read (a newer version, a codec it
    does not know): a miss, but not damage -- it is left for the readers that know it."""


def header_len(n_segments: int, coded: bool = False) -> int:
    return FIXED_BYTES + (_CODED.size if coded else 0) + 8 * n_segments + 8


def segment_count(nbytes: int, segment_bytes: int) -> int:
    return -(-nbytes // segment_bytes)


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    """An object's header. ``nbytes`` and ``segment_bytes`` are those of the stored payload (the
    frames, for a chunk stored through a codec: ``coding`` then has the raw sizes)."""

    key: ChunkKey
    nbytes: int
    segment_bytes: int
    checksums: tuple[int, ...]
    coding: Coding | None = None

    @property
    def length(self) -> int:
        return header_len(len(self.checksums), self.coding is not None)

    @property
    def object_bytes(self) -> int:
        return self.length + self.nbytes

    @property
    def raw_nbytes(self) -> int:
        """What a read of the whole chunk returns."""
        return self.nbytes if self.coding is None else self.coding.raw_nbytes

    @classmethod
    def for_payload(cls, key: ChunkKey, payload: memoryview, segment_bytes: int,
                    coding: Coding | None = None) -> ObjectHeader:
        n = len(payload)
        sums = tuple(
            xxhash.xxh3_64_intdigest(payload[i : i + segment_bytes]) for i in range(0, n, segment_bytes)
        )
        return cls(key, n, segment_bytes, sums, coding)

    def encode(self) -> bytes:
        n, c = len(self.checksums), self.coding
        fixed = (self.key, self.nbytes, self.segment_bytes, n)
        if c is None:
            body = _FIXED.pack(MAGIC, VERSION, 0, header_len(n), *fixed)
        else:
            body = _FIXED.pack(MAGIC, VERSION_CODED, c.codec_id, header_len(n, True), *fixed)
            body += _CODED.pack(c.raw_nbytes, c.raw_seg)
        body += struct.pack(f"<{n}Q", *self.checksums)
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, raw: bytes | memoryview, key: ChunkKey | None = None) -> ObjectHeader:
        """Parse and check a header (``raw`` may run on into the payload). Raises CorruptObject
        naming what is wrong; with ``key``, also when the header belongs to another chunk."""
        hlen = peek_header_len(raw)
        if len(raw) < hlen:
            raise CorruptObject(f"header truncated ({len(raw)} of {hlen} bytes)")
        _m, version, flags, _h, hkey, nbytes, seg, nseg = _FIXED.unpack_from(raw)
        end = hlen - 8
        (stored,) = struct.unpack_from("<Q", raw, end)
        if xxhash.xxh3_64_intdigest(raw[:end]) != stored:
            raise CorruptObject("header checksum mismatch")
        if seg <= 0 or nseg != segment_count(nbytes, seg):
            raise CorruptObject("segment table mismatch")
        if key is not None and hkey != key:
            raise CorruptObject(f"object holds chunk {hkey.hex()}")
        coding, sums_at = None, FIXED_BYTES
        if version == VERSION_CODED:
            raw_nbytes, raw_seg = _CODED.unpack_from(raw, FIXED_BYTES)
            if flags not in CODEC_NAMES:
                raise UnknownFormat(f"unknown codec id {flags}")
            try:
                coding = Coding.parse(flags, raw_nbytes, raw_seg, nbytes, seg)
            except ValueError as exc:
                raise CorruptObject(str(exc)) from None
            sums_at += _CODED.size
        sums = struct.unpack_from(f"<{nseg}Q", raw, sums_at)
        return cls(ChunkKey(bytes(hkey)), nbytes, seg, sums, coding)

    def span(self, offset: int, length: int) -> tuple[int, int]:
        """Payload bytes ``[lo, hi)`` to read (whole segments) for raw bytes ``[offset,
        offset+length)`` of the chunk, which must lie within it."""
        if self.coding is None:
            return self.covering(offset, length)[2:]
        f0, f1 = self.coding.frames_for(offset, length)
        return f0 * self.coding.frame, f1 * self.coding.frame

    def covering(self, offset: int, length: int) -> tuple[int, int, int, int]:
        """Segments ``[s0, s1)`` covering payload bytes ``[offset, offset+length)``, and the
        payload range ``[lo, hi)`` they span."""
        seg = self.segment_bytes
        s0, s1 = offset // seg, max(offset // seg, -(-(offset + length) // seg))
        return s0, s1, s0 * seg, min(s1 * seg, self.nbytes)

    def bad_segment(self, part: memoryview, s0: int) -> int | None:
        """Index of the first segment of ``part`` (payload from segment ``s0`` on) whose
        checksum fails, or None."""
        seg = self.segment_bytes
        for i in range(0, len(part), seg):
            if xxhash.xxh3_64_intdigest(part[i : i + seg]) != self.checksums[s0 + i // seg]:
                return s0 + i // seg
        return None


def peek_header_len(raw: bytes | memoryview) -> int:
    """Header length from the fixed part of an object. Raises CorruptObject."""
    if len(raw) < FIXED_BYTES:
        raise CorruptObject(f"object truncated ({len(raw)} bytes)")
    magic, version, _flags, hlen, _key, _n, _seg, nseg = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptObject(f"bad magic {bytes(magic)!r}")
    if version not in (VERSION, VERSION_CODED):
        raise UnknownFormat(f"unsupported version {version}")
    if hlen != header_len(nseg, version == VERSION_CODED):
        raise CorruptObject("header length mismatch")
    return hlen
