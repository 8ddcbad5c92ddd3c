"""Lossy KV codecs for the lower tiers: fp8, int8 and int4 frames of one segment (one layer of
one chunk), each decodable alone.

A segment holds ``kv`` halves (K then V; MLA: one latent) of rows of ``head_dim`` elements in
``dtype`` (see :mod:`kvtier.core.layout`; the vLLM page formats keep the same K-then-V halves of
head_dim-wide rows). As KIVI does, **keys are quantized per channel** (a scale per head_dim
column over a group of :data:`GROUP_ROWS` consecutive rows: tokens of one head in kvtier's
layout), because outlier channels dominate K, and **values per token** (a scale per row), because
attention mixes V rows and each row's error should stay its own. A latent (``kv`` = 1) is
quantized per token.

Frame of one segment (integers little-endian)::

    magic "KVQ1", codec u8, dtype u8, kv u8, reserved u8, head_dim u32, raw_bytes u64,
    rows u32 (rows of one half), group u32 (rows per K scale group), then per half:
    the quantized elements (zero-padded to a multiple of 4 bytes), then its scales (float16)

A frame names its codec and the raw dtype, so any reader decodes it whatever its own tier's
codec is; it carries no checksum of its own: the tier checksums the stored bytes.

Error bounds (what :func:`error_bound` returns and the tests check, per element ``x`` of a
group or row whose largest magnitude is ``a`` and range is ``r``):

- ``int8``: symmetric, ``|err| <= a / 254`` (half a step of ``a / 127``), plus float rounding;
- ``int4``: asymmetric (a minimum and a step per group), ``|err| <= r / 30``;
- ``fp8``: float8 e4m3 with a scale mapping ``a`` to 448, ``|err| <= |x| / 16 + a / 2**9 / 448``.

A segment that cannot be framed (non-finite values, a size that is not whole rows, a head_dim
that int4 cannot pack, scales beyond float16) raises :class:`CodecError`; the tier then stores it
raw. Nothing lossy happens unless a user configures a codec: ``"none"`` is the default.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from kvtier.tiers.codec_types import (
    CODEC_IDS,
    CODEC_NAMES,
    DTYPE_NAMES,
    DTYPES,
    CodecError,
    KVFormat,
)
from kvtier.tiers.quantizers import _F16_TINY, _QUANT, FP8_MAX, GROUP_ROWS, _group, _grouped

MAGIC = b"KVQ1"
_HEAD = struct.Struct("<4sBBBBIQII")
HEADER_BYTES = 32


# -- sizes ------------------------------------------------------------------------------------
def _rows(raw_bytes: int, fmt: KVFormat) -> int:
    per_row = fmt.kv * fmt.head_dim * fmt.itemsize
    if raw_bytes <= 0 or raw_bytes % per_row:
        raise CodecError(f"a segment of {raw_bytes} bytes is not whole rows of {fmt}")
    return raw_bytes // per_row


def _data_bytes(codec: str, n: int) -> int:
    """Bytes of ``n`` quantized elements in a frame, padded so the scales after them align."""
    data = n // 2 if codec == "int4" else n
    return -(-data // 4) * 4


def _half_bytes(codec: str, rows: int, head_dim: int, per_channel: bool) -> int:
    n = rows * head_dim
    data = _data_bytes(codec, n)
    scales_per = 2 if codec == "int4" else 1  # a minimum and a step, or a step
    if per_channel:
        groups = -(-rows // _group(rows))
        return data + 2 * scales_per * groups * head_dim
    return data + 2 * scales_per * rows


def frame_bytes(codec: str, raw_bytes: int, fmt: KVFormat) -> int:
    """Bytes of the frame of a segment of ``raw_bytes``; CodecError if it cannot be framed."""
    if codec not in CODEC_IDS:
        raise CodecError(f"no frame for codec {codec!r}")
    rows = _rows(raw_bytes, fmt)
    if codec == "int4" and (rows * fmt.head_dim) % 2:
        raise CodecError("int4 packs two elements a byte: a half needs an even element count")
    return HEADER_BYTES + sum(_half_bytes(codec, rows, fmt.head_dim, _per_channel(codec, fmt, half))
                              for half in range(fmt.kv))


def bytes_ratio(codec: str, fmt: KVFormat, raw_bytes: int) -> float:
    """Stored bytes over the bytes of the same KV in bfloat16 (the issue's yardstick)."""
    if codec == "none":
        return fmt.itemsize / 2
    return frame_bytes(codec, raw_bytes, fmt) / (raw_bytes / fmt.itemsize * 2)


def _aligned(t: torch.Tensor, align: int) -> torch.Tensor:
    """``t`` itself, or a copy when its bytes do not start on an ``align``-byte boundary (a
    view as a wider dtype needs one)."""
    return t if t.storage_offset() % align == 0 else t.clone()


def _per_channel(codec: str, fmt: KVFormat, half: int) -> bool:
    return codec != "fp8" and fmt.kv == 2 and half == 0


# -- frames -----------------------------------------------------------------------------------
def encode(codec: str, raw: torch.Tensor, fmt: KVFormat, out: torch.Tensor | None = None) -> torch.Tensor:
    """The frame of one segment (``raw``: its bytes, a CPU ``uint8`` tensor) as a ``uint8``
    tensor, written into ``out`` when given (exactly :func:`frame_bytes` long). Raises
    CodecError when the segment cannot be framed with ``codec``."""
    size = frame_bytes(codec, raw.numel(), fmt)
    rows = _rows(raw.numel(), fmt)
    d = fmt.head_dim
    x = raw.view(DTYPES[fmt.dtype][1]).view(fmt.kv, rows, d)
    if not bool(torch.isfinite(x).all()):
        raise CodecError("non-finite KV values: stored raw")
    frame = torch.empty(size, dtype=torch.uint8) if out is None else out
    if frame.numel() != size or frame.dtype != torch.uint8:
        raise ValueError(f"a frame of {codec} here is {size} bytes, got an out of {frame.numel()}")
    head = _HEAD.pack(MAGIC, CODEC_IDS[codec], DTYPES[fmt.dtype][0], fmt.kv, 0, d, raw.numel(), rows,
                      _group(rows))
    frame[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    frame[len(head) : HEADER_BYTES] = 0
    quant = _QUANT[codec][0]
    pos = HEADER_BYTES
    for half in range(fmt.kv):
        elems, scales = quant(x[half].float(), _per_channel(codec, fmt, half))
        data = _data_bytes(codec, rows * d)
        frame[pos : pos + elems.numel()] = elems
        frame[pos + elems.numel() : pos + data] = 0
        pos += data
        frame[pos : pos + scales.numel()] = scales
        pos += scales.numel()
    assert pos == size
    return frame


@dataclass(frozen=True, slots=True)
class FrameInfo:
    codec: str
    fmt: KVFormat
    raw_bytes: int
    rows: int


def read_header(frame: torch.Tensor | bytes | memoryview) -> FrameInfo:
    """The codec, format and raw size a frame names; CodecError when it is not a valid frame."""
    head = bytes(frame[:HEADER_BYTES].numpy() if isinstance(frame, torch.Tensor) else frame[:HEADER_BYTES])
    if len(head) < HEADER_BYTES:
        raise CodecError("frame truncated")
    magic, cid, dcode, kv, _r, d, raw_bytes, rows, group = _HEAD.unpack_from(head)
    if magic != MAGIC or cid not in CODEC_NAMES or dcode not in DTYPE_NAMES or kv not in (1, 2):
        raise CodecError("not a KV codec frame")
    try:
        fmt = KVFormat(DTYPE_NAMES[dcode], d, kv)
    except ValueError as exc:
        raise CodecError(f"bad frame header: {exc}") from None
    if _rows(raw_bytes, fmt) != rows or group != _group(rows):
        raise CodecError("frame header sizes disagree")
    return FrameInfo(CODEC_NAMES[cid], fmt, raw_bytes, rows)


def decode(frame: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The raw bytes of the segment a frame holds (``uint8``), written into ``out`` when given
    (of the raw size the frame names, any device). CodecError when ``frame`` is not a whole,
    valid frame (a mismatching ``out`` size is also a CodecError: bytes of another entry)."""
    info = read_header(frame)
    if frame.numel() != frame_bytes(info.codec, info.raw_bytes, info.fmt):
        raise CodecError(f"a {info.codec} frame of {frame.numel()} bytes: wrong size for its header")
    if out is not None and out.numel() != info.raw_bytes:
        raise CodecError(f"a frame of {info.raw_bytes} raw bytes read into {out.numel()}")
    try:
        return _decode(info, frame, out)
    except CodecError:
        raise
    except (RuntimeError, ValueError) as exc:  # never an exception a reader does not expect
        raise CodecError(f"undecodable {info.codec} frame: {exc}") from None


def _decode(info: FrameInfo, frame: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    fmt, rows, d = info.fmt, info.rows, info.fmt.head_dim
    dequant = _QUANT[info.codec][1]
    dtype = DTYPES[fmt.dtype][1]
    direct = (out is not None and out.device.type == "cpu" and out.is_contiguous()
              and out.storage_offset() % fmt.itemsize == 0)
    result = out if direct else torch.empty(info.raw_bytes, dtype=torch.uint8)
    target = result.view(dtype).view(fmt.kv, rows, d)  # type: ignore[union-attr]
    top = torch.finfo(dtype).max
    pos = HEADER_BYTES
    for half in range(fmt.kv):
        pc = _per_channel(info.codec, fmt, half)
        n = rows * d // 2 if info.codec == "int4" else rows * d
        data = _data_bytes(info.codec, rows * d)
        elems = frame[pos : pos + n]
        pos += data
        ns = _half_bytes(info.codec, rows, d, pc) - data
        scales = _aligned(frame[pos : pos + ns], 2)
        pos += ns
        # a step rounded up can carry the largest value of a row just past the dtype's range
        target[half].copy_(dequant(elems, scales, rows, d, pc).clamp_(-top, top))
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result  # type: ignore[return-value]


def error_bound(codec: str, raw: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Per element, the largest error :func:`decode` of :func:`encode` may show (float32,
    shaped ``[kv, rows, head_dim]``), from the bounds in the module docstring, plus the
    rounding of the raw dtype itself."""
    rows = _rows(raw.numel(), fmt)
    x = raw.view(DTYPES[fmt.dtype][1]).view(fmt.kv, rows, fmt.head_dim).float()
    eps = torch.finfo(DTYPES[fmt.dtype][1]).eps
    bounds = []
    for half in range(fmt.kv):
        h = x[half]
        pc = _per_channel(codec, fmt, half)
        if pc:
            g = _grouped(h, _group(rows))
            lo, hi = g.amin(dim=1), g.amax(dim=1)
            expand = lambda t: t.repeat_interleave(_group(rows), dim=0)[:rows]
            amax = expand(torch.maximum(lo.abs(), hi.abs()))
            rng = expand(hi - lo)
        else:
            amax = h.abs().amax(dim=1, keepdim=True).expand_as(h)
            rng = (h.amax(dim=1) - h.amin(dim=1))[:, None].expand_as(h)
        if codec == "int8":
            b = amax / 254.0 * 1.01
        elif codec == "int4":
            b = rng / 30.0 * 1.01 + amax * 2.0**-10  # float16 rounding of the minimum
        else:
            b = h.abs() / 16.0 + amax / 2.0**9 / FP8_MAX * 1.01 + amax * 2.0**-11
        bounds.append(b + h.abs() * eps * 2 + _F16_TINY)
    return torch.stack(bounds)


def measure(fmt: KVFormat | None = None, raw_bytes: int = 2 << 20, repeats: int = 3) -> dict[str, tuple[float, float]]:
    """Per codec, (stored/raw ratio, raw bytes decoded per second) on this machine, from
    segments of a typical layer (``fmt``: default bfloat16, head_dim 128) filled with
    Gaussian values: the figures ``codec = "auto"`` decides with. Takes about 50 ms on an idle machine."""
    import time

    fmt = fmt or KVFormat("bfloat16", 128, 2)
    seg = max(fmt.kv * fmt.head_dim * fmt.itemsize * GROUP_ROWS, 1 << 20)
    seg -= seg % (fmt.kv * fmt.head_dim * fmt.itemsize * GROUP_ROWS)
    count = max(1, raw_bytes // seg)
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(count * seg // fmt.itemsize, generator=gen).to(DTYPES[fmt.dtype][1]).view(torch.uint8)
    out: dict[str, tuple[float, float]] = {}
    for codec in CODEC_IDS:
        frames = [encode(codec, raw[i * seg : (i + 1) * seg], fmt) for i in range(count)]
        dst = torch.empty(seg, dtype=torch.uint8)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            for f in frames:
                decode(f, out=dst)
            best = min(best, time.perf_counter() - t0)
        out[codec] = (frames[0].numel() / seg, count * seg / best)
    return out
