"""What the remote tiers (:mod:`kvtier.tiers.valkey`, :mod:`kvtier.tiers.mooncake`) share.

Their object format is :mod:`kvtier.tiers.remote_format`, their connection health
:mod:`kvtier.tiers.remote_health`, their staging buffers :mod:`kvtier.tiers.remote_buffers`.

Guarantees every remote tier gives on top of :mod:`kvtier.tiers.base`:

- Every read verifies the header and the checksum of every segment it returns. A short, garbled
  or mismatching object, or a frame that does not decode, is a miss, counted in
  ``stats.misses``, ``stats.errors`` and ``stats.corrupt``, logged, and deleted best-effort;
  wrong bytes are never returned.
- No call waits longer than about ``timeout_s`` for the server. A server that is down, killed,
  stalled or refusing the credentials makes reads misses, ``commit`` return False, ``reserve``
  raise :class:`TierFullError` and deletes return False; each failure is counted in
  ``stats.errors`` and logged once per outage (:class:`~kvtier.tiers.remote_health.Health`).
- Construction never contacts the server in a way that can fail: a tier made while its server is
  down starts down and reconnects by itself at most every ``reconnect_interval_s``. An invalid
  config raises ValueError naming the field when the config is made.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import Tier, as_byte_tensor, check_key
from kvtier.tiers.codec_types import CodecError, KVFormat
from kvtier.tiers.coded import Coding, decode_range, encode_entry
from kvtier.tiers.remote_config import MooncakeTierConfig, ValkeyTierConfig
from kvtier.tiers.remote_format import (
    CorruptObject,
    ObjectHeader,
    UnknownFormat,
    header_len,
    segment_count,
)

log = logging.getLogger(__name__)

_BLOCK = 256 << 10
"""Bytes verified then copied at a time on reads (fits a core's L2 cache)."""


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
