"""What the remote tiers (:mod:`kvtier.tiers.valkey`, :mod:`kvtier.tiers.mooncake`) share.

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

Guarantees every remote tier gives on top of :mod:`kvtier.tiers.base`:

- Every read verifies the header and the checksum of every segment it returns. A short, garbled
  or mismatching object, or a frame that does not decode, is a miss, counted in
  ``stats.misses``, ``stats.errors`` and ``stats.corrupt``, logged, and deleted best-effort;
  wrong bytes are never returned.
- No call waits longer than about ``timeout_s`` for the server. A server that is down, killed,
  stalled or refusing the credentials makes reads misses, ``commit`` return False, ``reserve``
  raise :class:`TierFullError` and deletes return False; each failure is counted in
  ``stats.errors`` and logged once per outage (:class:`Health`).
- Construction never contacts the server in a way that can fail: a tier made while its server is
  down starts down and reconnects by itself at most every ``reconnect_interval_s``. An invalid
  config raises ValueError naming the field when the config is made.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.errors import KVTierError
from kvtier.tiers.base import Tier, TierStats, as_byte_tensor, check_key
from kvtier.tiers.codecs import CODEC_NAMES, CodecError, KVFormat
from kvtier.tiers.coded import Coding, decode_range, encode_entry
from kvtier.tiers.remote_config import MooncakeTierConfig, ValkeyTierConfig

log = logging.getLogger(__name__)

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


# -- connection health ------------------------------------------------------------------------
class Health:
    """Up/down state of one remote connection.

    After a failure the tier is down: calls fail fast (a miss, False) without touching the
    network until ``reconnect_interval_s`` has passed; then the next call tries the server again.
    Each failure is counted in ``stats.errors``; a warning is logged when the tier goes down and
    an info line when it comes back, so an outage logs two lines, not one per call.
    """

    def __init__(self, name: str, reconnect_interval_s: float, stats: TierStats) -> None:
        self.name = name
        self._interval = reconnect_interval_s
        self._stats = stats
        self._up = True
        self._retry_at = 0.0
        self._refused_at = -1e9
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self._up

    def ready(self) -> bool:
        """Whether a call may go to the server now."""
        return self._up or time.monotonic() >= self._retry_at

    def failed(self, what: str, exc: object) -> None:
        with self._lock:
            self._stats.errors += 1
            was_up, self._up = self._up, False
            self._retry_at = time.monotonic() + self._interval
        if was_up:
            log.warning("%s: %s failed, tier down (retrying every %.1fs): %s",
                        self.name, what, self._interval, exc)
        else:
            log.debug("%s: %s failed again: %s", self.name, what, exc)

    def refused(self, what: str, exc: object) -> None:
        """The server answered this call with an error (out of memory, say): counted, logged at
        most once per ``reconnect_interval_s`` (at least 5 s); the tier stays up."""
        self._stats.errors += 1
        now = time.monotonic()
        if now - self._refused_at >= max(self._interval, 5.0):
            self._refused_at = now
            log.warning("%s: %s failed: %s", self.name, what, exc)
        else:
            log.debug("%s: %s failed: %s", self.name, what, exc)

    def succeeded(self) -> None:
        if not self._up:
            with self._lock:
                was_up, self._up = self._up, True
            if not was_up:
                log.info("%s: server reachable again, tier up", self.name)


_BLOCK = 256 << 10
"""Bytes verified then copied at a time on reads (fits a core's L2 cache)."""


# -- staging buffers --------------------------------------------------------------------------
MIB = 1 << 20


def size_class(size: int) -> int:
    """Powers of two from 64 KiB up to 1 MiB, then whole MiB."""
    return 1 << max(16, (size - 1).bit_length()) if size <= MIB else -(-size // MIB) * MIB


class BufferPool:
    """Host buffers reused by size class, so that steady writes and reads do not fault in fresh
    memory for every chunk (expensive on virtual machines). Thread-safe; holds at most
    ``keep_bytes`` of idle buffers. Subclasses hook ``_new`` and ``_drop`` (registration)."""

    def __init__(self, keep_bytes: int = 512 * MIB) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._keep = keep_bytes
        self._pool_lock = threading.Lock()

    def take(self, size: int) -> torch.Tensor:
        """A buffer of at least ``size`` bytes (slice it); give it back when done."""
        cls = size_class(size)
        with self._pool_lock:
            stack = self._free.get(cls)
            if stack:
                self._kept -= cls
                return stack.pop()
        return self._new(cls)

    def give(self, buf: torch.Tensor) -> None:
        cls = buf.numel()
        with self._pool_lock:
            if self._kept + cls <= self._keep:
                self._free.setdefault(cls, []).append(buf)
                self._kept += cls
                return
        self._drop(buf)

    def clear(self) -> None:
        with self._pool_lock:
            bufs = [b for stack in self._free.values() for b in stack]
            self._free.clear()
            self._kept = 0
        for b in bufs:
            self._drop(b)

    def _new(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)

    def _drop(self, buf: torch.Tensor) -> None:
        pass


# -- the shared half of a remote tier ---------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Payload:
    """What a put stores for one chunk: ``data`` (its raw bytes, or a codec's frames) in segments
    of ``segment_bytes`` (None: one), and the ``coding`` of the frames."""

    data: torch.Tensor
    segment_bytes: int | None
    coding: Coding | None = None

    @property
    def raw_nbytes(self) -> int:
        return self.data.numel() if self.coding is None else self.coding.raw_nbytes


def _frames(part: memoryview) -> torch.Tensor:
    """Verified stored bytes as a tensor to decode (read-only bytes are copied: torch wants a
    writable buffer, and a compressed range is small next to what decoding it costs)."""
    if not len(part):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(part) if part.readonly else part, dtype=torch.uint8)


class RemoteTier(Tier):
    """Request checks, encoding, read verification and decoding, and damage handling shared by
    the remote tiers."""

    config: ValkeyTierConfig | MooncakeTierConfig

    def put(self, key: ChunkKey, data: object, segment_bytes: int | None = None, *,
            fmt: KVFormat | None = None) -> bool:
        """Like :meth:`Tier.put`: :meth:`put_many` of one entry (CPU data is sent from where it
        lies, without a staging copy; with a codec, KV goes as its frames)."""
        src = as_byte_tensor(data)
        if src.numel() == 0 or (src.device.type != "cpu" and not self._encodes(fmt)):
            return super().put(key, src, segment_bytes)
        outcome = self.put_many([key], [src], segment_bytes, fmts=[fmt])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    @property
    def codec(self) -> str:
        """The codec new KV chunks are stored with (any codec is read back)."""
        return self.config.codec

    def _encodes(self, fmt: KVFormat | None) -> bool:
        return fmt is not None and self.codec != "none"

    def _payloads(self, keys: Sequence[ChunkKey], srcs: Sequence[torch.Tensor], segment_bytes: int | None,
                  fmts: Sequence[KVFormat | None] | None) -> list[Payload] | None:
        """What a ``put_many`` stores for each entry (see :meth:`_payload`); None when one must
        go the default way (reserve, copy, commit): it is empty, or off the CPU and not KV to
        encode."""
        formats = [None] * len(srcs) if fmts is None else list(fmts)
        self._paired(keys, formats, "formats")
        if any(src.numel() == 0 or (src.device.type != "cpu" and not self._encodes(f))
               for src, f in zip(srcs, formats, strict=True)):
            return None
        return [self._payload(src, segment_bytes, f) for src, f in zip(srcs, formats, strict=True)]

    def _payload(self, src: torch.Tensor, segment_bytes: int | None, fmt: KVFormat | None) -> Payload:
        """The frames of ``src`` when this tier has a codec, ``fmt`` says what the bytes are and
        framing them saves bytes (:func:`~kvtier.tiers.coded.encode_entry`); else ``src`` as it
        is (copied to the CPU if it is KV off it)."""
        if not self._encodes(fmt):
            return Payload(src, segment_bytes)
        raw = src if src.device.type == "cpu" else src.cpu()
        coded = encode_entry(self.codec, raw, segment_bytes, fmt)
        if coded is None:  # refused, or nothing saved
            return Payload(raw, segment_bytes)
        frames, coding = coded
        return Payload(frames, coding.frame, coding)

    def pin_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One :meth:`contains_many` (one round trip), then the pins of those held."""
        with self._lock:
            held = self.contains_many(keys)
            for key, h in zip(keys, held, strict=True):
                if h:
                    self._pins[key] = self._pins.get(key, 0) + 1
        return held

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """One :meth:`contains_many` (one round trip)."""
        return next((n for n, held in enumerate(self.contains_many(keys)) if not held), len(keys))

    def footprint(self, nbytes: int, segment_bytes: int | None = None, coded: bool = False) -> int:
        """Bytes charged for an object of ``nbytes`` of payload (``coded``: a codec's frames;
        a raw chunk that the tier's codec then compresses is charged what it takes framed)."""
        return header_len(segment_count(nbytes, segment_bytes or nbytes), coded) + nbytes

    def _check_request(self, key: ChunkKey, nbytes: int, segment_bytes: int | None,
                       coded: bool = False) -> tuple[ChunkKey, int, int]:
        """Validate a write of ``nbytes`` of payload; returns (key, segment bytes, bytes charged)."""
        key = check_key(key)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"{self.name}: entry size must be a positive int, got {nbytes!r}")
        seg = nbytes if segment_bytes is None else segment_bytes
        if not isinstance(seg, int) or seg <= 0:
            raise ValueError(f"{self.name}: segment_bytes must be a positive int, got {segment_bytes!r}")
        charge = self.footprint(nbytes, seg, coded)
        if charge > self.capacity:
            raise ValueError(
                f"{self.name}: entry of {nbytes} bytes ({charge} stored) is larger than the "
                f"tier's capacity of {self.capacity} bytes"
            )
        return key, seg, charge

    def _check_range(self, nbytes: int, offset: int, length: int | None, out: torch.Tensor | None) -> int:
        length = nbytes - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > nbytes:
            raise ValueError(f"{self.name}: range [{offset}, {offset + length}) outside entry of {nbytes} bytes")
        if out is not None and (out.numel() != length or out.dtype != torch.uint8):
            raise ValueError(f"{self.name}: out must be a uint8 tensor of {length} bytes")
        return length

    def _deliver(
        self,
        key: ChunkKey,
        header: ObjectHeader,
        part: memoryview,
        lo: int,
        offset: int,
        length: int,
        out: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Verify ``part`` (payload bytes from ``lo``, whole segments: ``header.span(offset,
        length)``) and deliver raw bytes ``[offset, offset+length)`` of the chunk into ``out`` or
        a new tensor, decoding frames if the chunk is coded. A mismatch or a frame that does not
        decode is handled as damage (None; the content of ``out`` is then unspecified)."""
        coding = header.coding
        if coding is None:
            return self._copy_out(key, header, part, lo, offset, length, out)
        bad = header.bad_segment(part, lo // coding.frame)
        if bad is not None:
            return self._damaged(key, f"checksum mismatch in segment {bad}")
        target = out if out is None or out.is_contiguous() else None  # decoding writes views
        try:
            got = decode_range(coding, _frames(part), lo // coding.frame, offset, length, target)
        except CodecError as exc:
            return self._damaged(key, f"undecodable frame: {exc}")
        if out is not None and got is not out:
            got = out.copy_(got)
        self.stats.hits += 1
        self.stats.lossy_hits += 1
        self.stats.bytes_read += length
        return got

    def _copy_out(self, key: ChunkKey, header: ObjectHeader, part: memoryview, lo: int, offset: int,
                  length: int, out: torch.Tensor | None) -> torch.Tensor | None:
        """:meth:`_deliver` of a raw chunk. Verification and copy go block by block, so the copy
        reads bytes the checksum just brought into the cache."""
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dst_t = out if direct else torch.empty(length, dtype=torch.uint8)
        dst = memoryview(dst_t.numpy()).cast("B")  # type: ignore[union-attr]
        seg, start, end = header.segment_bytes, offset - lo, offset - lo + length
        block = seg * max(1, _BLOCK // seg)
        for b0 in range(0, len(part), block):
            b1 = min(b0 + block, len(part))
            bad = header.bad_segment(part[b0:b1], (lo + b0) // seg)
            if bad is not None:
                return self._damaged(key, f"checksum mismatch in segment {bad}")
            a, z = max(b0, start), min(b1, end)
            if z > a:
                dst[a - start : z - start] = part[a:z]
        if not direct:
            out = dst_t if out is None else out.copy_(dst_t)
        self.stats.hits += 1
        self.stats.bytes_read += length
        return out

    def _refused(self, key: ChunkKey, exc: CorruptObject) -> None:
        """A read whose object failed its checks: damage (dropped), or a format this version
        does not read (a counted miss; the object stays for the readers that know it)."""
        if not isinstance(exc, UnknownFormat):
            return self._damaged(key, str(exc))
        log.warning("%s: chunk %s is a miss: %s (left in place)", self.name, key.hex(), exc)
        self.stats.misses += 1
        return None

    def _damaged(self, key: ChunkKey, why: str, corrupt: bool = True) -> None:
        """A read found the object missing or damaged: a counted, logged miss; the object and
        its index entry are dropped best-effort."""
        log.warning("%s: chunk %s is a miss: %s", self.name, key.hex(), why)
        self.stats.misses += 1
        self.stats.errors += 1
        if corrupt:
            self.stats.corrupt += 1
        try:
            self._drop_damaged(key)
        except Exception as exc:  # noqa: BLE001 - best effort on the failure path
            log.debug("%s: could not drop chunk %s: %s", self.name, key.hex(), exc)

    def _drop_damaged(self, key: ChunkKey) -> None:
        """Remove a damaged object and its bookkeeping, ignoring pins (its bytes are useless)."""
        raise NotImplementedError
