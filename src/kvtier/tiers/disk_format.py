"""The file format of the SSD tier (:mod:`kvtier.tiers.disk`): one file per chunk, a header
then the payload; writing and checking a header, and what the tier's index keeps of one
(:class:`_Entry`).

File format (all integers little-endian)::

    header  (header_len bytes, a multiple of 4096)
        magic "KVTC", version u16 (2), flags u16, header_len u32, key 16B,
        payload_len u64, segment_bytes u64, n_segments u32, write sequence number u64,
        position u32 (the chunk's index in its sequence, 0xffffffff: unknown),
        n_segments x u64 XXH3-64 checksums (one per segment, i.e. per layer of a chunk),
        u64 XXH3-64 of all the header bytes before it, zero padding
    payload (payload_len bytes, zero-padded to a multiple of 4096)

Version 3 (written for entries stored through a codec, :mod:`kvtier.tiers.coded`) adds, after
the position, raw_nbytes u64, raw_segment_bytes u64 and the KV format (dtype code u8, kv u8,
head_dim u32), and keeps the codec's id in ``flags``;
its payload is the codec's frames, one segment each. Version 4 (written for a chunk of a tenant)
has version 3's fields (raw_nbytes 0 and no format for a raw entry) and then the tenant: its
length u16 and its UTF-8 bytes (at most :data:`MAX_TENANT_BYTES`), before the checksums; the
tenant decides where the chunk goes when it leaves SSD (the tenant's prefix of the remote tier),
after a restart too. Version 1 files (no position) are still read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvtier.core.keys import KEY_BYTES, MAX_TENANT_BYTES, ChunkKey
from kvtier.tiers.base import round_up
from kvtier.tiers.codec_types import DTYPE_NAMES, DTYPES, KVFormat
from kvtier.tiers.coded import Coding

MAGIC = b"KVTC"
VERSION = 2
_FIXED_V1 = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQ")
_FIXED = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQI")
_FIXED_V3 = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQIQQBBI")
_FIXED_V4 = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQIQQBBIH")
MAX_HEADER_BYTES = 16 << 20
"""A header read on reopen at most (its checksums: 8 bytes a segment)."""
_NO_POSITION = 0xFFFFFFFF
_SUFFIX = ".kvc"


@dataclass(slots=True)
class _Entry:
    nbytes: int
    segment_bytes: int
    header_len: int
    checksums: tuple[int, ...]
    position: int | None = None
    coding: Coding | None = None
    """Set when the payload holds a codec's frames (``nbytes``/``segment_bytes`` are then the
    stored sizes, the coding has the raw ones)."""
    tenant: str = ""

    @property
    def file_bytes(self) -> int:
        return self.header_len + round_up(self.nbytes)


def header_len_for(n_segments: int, coded: bool = False, tenant_bytes: int = 0) -> int:
    """The header length of an entry of ``n_segments`` (``coded``: a codec's frames;
    ``tenant_bytes``: the UTF-8 length of its tenant, 0 for none)."""
    if tenant_bytes:
        return round_up(_FIXED_V4.size + tenant_bytes + 8 * n_segments + 8)
    return round_up((_FIXED_V3 if coded else _FIXED).size + 8 * n_segments + 8)


def tenant_bytes(tenant: str) -> bytes:
    """A tenant's name as a header holds it; ValueError if it cannot."""
    if not isinstance(tenant, str):
        raise TypeError(f"disk: a tenant is a string, got {type(tenant).__name__}")
    raw = tenant.encode()
    if len(raw) > MAX_TENANT_BYTES:
        raise ValueError(f"disk: a tenant name is at most {MAX_TENANT_BYTES} bytes, got {len(raw)}")
    return raw


def _encode_header(
    key: ChunkKey, nbytes: int, segment_bytes: int, checksums: list[int], seq: int,
    position: int | None = None, coding: Coding | None = None, tenant: str = "",
) -> bytes:
    name = tenant_bytes(tenant)
    hlen = header_len_for(len(checksums), coding is not None, len(name))
    pos = _NO_POSITION if position is None or not 0 <= position < _NO_POSITION else position
    if name:
        flags, raw_n, raw_seg, dcode, kv, hd = 0, 0, 0, 0, 0, 0
        if coding is not None:
            fmt = coding.fmt
            dcode, kv, hd = (DTYPES[fmt.dtype][0], fmt.kv, fmt.head_dim) if fmt is not None else (0, 0, 0)
            flags, raw_n, raw_seg = coding.codec_id, coding.raw_nbytes, coding.raw_seg
        body = _FIXED_V4.pack(MAGIC, 4, flags, hlen, key, nbytes, segment_bytes, len(checksums), seq, pos,
                              raw_n, raw_seg, dcode, kv, hd, len(name)) + name
    elif coding is None:
        body = _FIXED.pack(MAGIC, VERSION, 0, hlen, key, nbytes, segment_bytes, len(checksums), seq, pos)
    else:
        fmt = coding.fmt
        dcode, kv, hd = (DTYPES[fmt.dtype][0], fmt.kv, fmt.head_dim) if fmt is not None else (0, 0, 0)
        body = _FIXED_V3.pack(MAGIC, 3, coding.codec_id, hlen, key, nbytes, segment_bytes,
                              len(checksums), seq, pos, coding.raw_nbytes, coding.raw_seg, dcode, kv, hd)
    body += struct.pack(f"<{len(checksums)}Q", *checksums)
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return body.ljust(hlen, b"\0")


def _header_format(dcode: int, kv: int, head_dim: int) -> KVFormat | None:
    if dcode == 0:
        return None
    if dcode not in DTYPE_NAMES:
        raise ValueError(f"unknown KV dtype code {dcode}")
    return KVFormat(DTYPE_NAMES[dcode], head_dim, kv)  # ValueError on a bad kv or head_dim


def _decode_header(raw: bytes) -> tuple[ChunkKey, _Entry, int]:
    """Parse and check a header; returns key, entry and write sequence number, or raises
    ValueError naming what is wrong."""
    if len(raw) < _FIXED_V1.size:
        raise ValueError("header truncated")
    magic, version = struct.unpack_from("<4sH", raw)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    raw_sizes = None
    name = b""
    if version == 1:
        fixed, position = _FIXED_V1, _NO_POSITION
        _m, _v, _flags, hlen, key, nbytes, seg, nseg, seq = fixed.unpack_from(raw)
    elif version == VERSION:
        fixed = _FIXED
        _m, _v, _flags, hlen, key, nbytes, seg, nseg, seq, position = fixed.unpack_from(raw)
    elif version == 3:
        fixed = _FIXED_V3
        if len(raw) < fixed.size:
            raise ValueError("header truncated")
        _m, _v, flags, hlen, key, nbytes, seg, nseg, seq, position, raw_n, raw_seg, dcode, kv, hd = \
            fixed.unpack_from(raw)
        raw_sizes = (flags, raw_n, raw_seg, _header_format(dcode, kv, hd))
    elif version == 4:
        fixed = _FIXED_V4
        if len(raw) < fixed.size:
            raise ValueError("header truncated")
        _m, _v, flags, hlen, key, nbytes, seg, nseg, seq, position, raw_n, raw_seg, dcode, kv, hd, tlen = \
            fixed.unpack_from(raw)
        if not 0 < tlen <= MAX_TENANT_BYTES or len(raw) < fixed.size + tlen:
            raise ValueError("tenant length mismatch")
        name = bytes(raw[fixed.size : fixed.size + tlen])
        if raw_n:
            raw_sizes = (flags, raw_n, raw_seg, _header_format(dcode, kv, hd))
    else:
        raise ValueError(f"unsupported version {version}")
    start = fixed.size + len(name)  # the checksums
    if hlen != round_up(start + 8 * nseg + 8) or len(raw) < hlen:
        raise ValueError("header length mismatch")
    if seg <= 0 or nseg != -(-nbytes // seg):
        raise ValueError("segment table mismatch")
    end = start + 8 * nseg
    (stored,) = struct.unpack_from("<Q", raw, end)
    if xxhash.xxh3_64_intdigest(raw[:end]) != stored:
        raise ValueError("header checksum mismatch")
    try:
        tenant = name.decode()
    except UnicodeDecodeError:
        raise ValueError("tenant is not UTF-8") from None
    checksums = struct.unpack_from(f"<{nseg}Q", raw, start)
    pos = None if position == _NO_POSITION else position
    coding = None if raw_sizes is None else Coding.parse(raw_sizes[0], raw_sizes[1], raw_sizes[2], nbytes, seg,
                                                         raw_sizes[3])
    return ChunkKey(key), _Entry(nbytes, seg, hlen, tuple(checksums), pos, coding, tenant), seq
