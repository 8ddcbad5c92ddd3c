"""Entries stored through a codec: what the SSD and remote tiers share to keep a compressed
payload behind the raw-bytes contract of :mod:`kvtier.tiers.base`.

A tier configured with a codec (``codec = "int8"``, ...) encodes each segment of an entry (one
layer of a chunk) into a frame of :mod:`kvtier.tiers.codecs` when the entry is written and
decodes the frames a read touches. Callers see raw bytes only: ``entry_bytes``, offsets and
lengths are in raw bytes, a layer read decodes one frame, and a chunk's key does not change with
its codec. The tier's header records the codec and the raw sizes (:class:`Coding`); the stored
payload is the frames one after the other, all of one size, each a segment the tier checksums
on its own. A reader decodes whatever codec the header names, whatever its own is.

Entries that cannot be framed (no format given, sizes that are not whole segments of whole
rows, values a codec refuses) are stored raw; so is everything with ``codec = "none"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvtier.tiers.codec_types import CODEC_IDS, CODEC_NAMES, CodecError, KVFormat
from kvtier.tiers.codecs import decode, encode, frame_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Coding:
    """How a stored payload maps to the raw entry: ``codec`` frames of ``frame`` bytes each,
    one per raw segment of ``raw_seg`` bytes, ``raw_nbytes`` in all."""

    codec: str
    raw_nbytes: int
    raw_seg: int
    frame: int
    fmt: KVFormat | None = None
    """What the raw bytes are (kept so that a copy promoted from here is compressed again
    further down); None where the tier's header does not record it."""

    @property
    def segments(self) -> int:
        return self.raw_nbytes // self.raw_seg

    @property
    def codec_id(self) -> int:
        return CODEC_IDS[self.codec]

    @classmethod
    def parse(cls, codec_id: int, raw_nbytes: int, raw_seg: int, stored_nbytes: int,
              stored_seg: int, fmt: KVFormat | None = None) -> Coding:
        """The coding a header records; ValueError when its fields disagree."""
        if codec_id not in CODEC_NAMES:
            raise ValueError(f"unknown codec id {codec_id}")
        if raw_seg <= 0 or raw_nbytes <= 0 or raw_nbytes % raw_seg:
            raise ValueError("coded entry: raw sizes are not whole segments")
        if stored_seg <= 0 or stored_nbytes != stored_seg * (raw_nbytes // raw_seg):
            raise ValueError("coded entry: stored sizes disagree with the raw ones")
        return cls(CODEC_NAMES[codec_id], raw_nbytes, raw_seg, stored_seg, fmt)

    def frames_for(self, offset: int, length: int) -> tuple[int, int]:
        """Frames ``[f0, f1)`` covering raw bytes ``[offset, offset + length)``."""
        if offset < 0 or length < 0 or offset + length > self.raw_nbytes:
            raise ValueError(f"range [{offset}, {offset + length}) outside entry of {self.raw_nbytes} bytes")
        return offset // self.raw_seg, -(-(offset + length) // self.raw_seg)


def encode_entry(codec: str, raw: torch.Tensor, segment_bytes: int | None,
                 fmt: KVFormat | None) -> tuple[torch.Tensor, Coding] | None:
    """The frames of a whole entry (``raw``: a flat CPU ``uint8`` tensor) and their coding, or
    None when the entry is to be stored raw (codec ``"none"``, no format, sizes or values a
    codec refuses -- logged at debug level -- or frames no smaller than the raw bytes)."""
    if codec == "none" or fmt is None or raw.device.type != "cpu":
        return None
    n = raw.numel()
    seg = segment_bytes or n
    if n == 0 or not isinstance(seg, int) or seg <= 0 or n % seg:
        return None
    try:
        fsize = frame_bytes(codec, seg, fmt)
        out = torch.empty(fsize * (n // seg), dtype=torch.uint8)
        for i in range(n // seg):
            encode(codec, raw[i * seg : (i + 1) * seg], fmt, out=out[i * fsize : (i + 1) * fsize])
    except CodecError as exc:
        log.debug("entry stored raw: %s", exc)
        return None
    if out.numel() >= n:  # nothing saved (tiny rows: the scales outweigh the elements)
        return None
    return out, Coding(codec, n, seg, fsize, fmt)


def decode_range(coding: Coding, frames: torch.Tensor, f0: int, offset: int, length: int,
                 out: torch.Tensor | None) -> torch.Tensor:
    """Raw bytes ``[offset, offset + length)`` of an entry from its frames ``f0...``
    (``frames``: those frames, verified by the tier), into ``out`` when given. A frame that
    fails to decode raises :class:`~kvtier.tiers.codec_types.CodecError` (the tier's read is then a
    miss on a damaged entry)."""
    seg, fsize = coding.raw_seg, coding.frame
    count = frames.numel() // fsize
    lo = f0 * seg
    whole = (offset, length) == (lo, count * seg) and (
        out is None or (out.device.type == "cpu" and out.is_contiguous()))
    target = (out if out is not None else torch.empty(length, dtype=torch.uint8)) if whole else \
        torch.empty(count * seg, dtype=torch.uint8)
    for i in range(count):
        decode(frames[i * fsize : (i + 1) * fsize], out=target[i * seg : (i + 1) * seg])
    if whole:
        return target
    part = target[offset - lo : offset - lo + length]
    if out is None:
        return part.clone()
    out.copy_(part)
    return out
