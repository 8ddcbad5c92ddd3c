"""A codec applied to KV the way the store stores chunks (for :mod:`kvtier.bench.codecs`): the
history's chunks packed layer-major, encoded and decoded with their times, unpacked back into
per-layer KV, and read back from an SSD tier with the codec."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.store.packing import chunk_view, pack_chunk
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.coded import decode_range, encode_entry
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_config import DiskTierConfig

Layers = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (K, V), each ``[kv_heads, tokens, head_dim]``."""


def pack_chunks(kv: Layers, layout: KVLayout, count: int) -> list[torch.Tensor]:
    """The layer-major bytes of the first ``count`` chunks of ``kv``."""
    out = []
    for i in range(count):
        buf = torch.empty(layout.chunk_bytes, dtype=torch.uint8)
        pack_chunk(buf, kv, i, layout)
        out.append(buf)
    return out


@dataclass(slots=True)
class _Coded:
    chunks: list[torch.Tensor]
    """Each chunk's raw bytes after encode and decode."""
    stored: list[int]
    """Bytes the tier stores per chunk."""
    refused: list[bool]
    """Per chunk: the codec refused it (stored raw)."""
    encode_s: list[list[float]]
    """Per timing run, per chunk."""
    decode_s: list[list[float]]


def roundtrip(codec: str, chunks: list[torch.Tensor], layout: KVLayout, fmt: KVFormat | None,
              runs: int) -> _Coded:
    """Every chunk through ``codec`` and back, each encode and decode timed ``runs`` times."""
    coded = _Coded([], [], [], [], [])
    for run in range(runs):
        enc_t, dec_t = [], []
        for i, raw in enumerate(chunks):
            t0 = time.perf_counter()
            framed = None if codec == "none" else encode_entry(codec, raw, layout.layer_bytes, fmt)
            t1 = time.perf_counter()
            if framed is None:
                back = raw.clone()
                t2 = t1
            else:
                frames, coding = framed
                back = decode_range(coding, frames, 0, 0, coding.raw_nbytes, None)
                t2 = time.perf_counter()
            enc_t.append(t1 - t0)
            dec_t.append(t2 - t1)
            if run == 0:
                coded.chunks.append(back)
                coded.stored.append(raw.numel() if framed is None else framed[0].numel())
                coded.refused.append(framed is None and codec != "none")
        coded.encode_s.append(enc_t)
        coded.decode_s.append(dec_t)
    return coded


def unpack_chunks(chunks: list[torch.Tensor], exact: Layers, layout: KVLayout) -> Layers:
    """``exact`` with its first ``len(chunks)`` chunks' tokens replaced by the chunks' KV."""
    view = torch.stack([chunk_view(c, layout) for c in chunks])  # [n, layers, kv, heads, C, d]
    n = len(chunks) * layout.chunk_tokens
    out: Layers = []
    for layer, (k, v) in enumerate(exact):
        halves = []
        for j, t in enumerate((k, v)):
            coded = view[:, layer, j].permute(1, 0, 2, 3).reshape(t.shape[0], n, t.shape[2])
            halves.append(torch.cat([coded, t[:, n:]], dim=1))
        out.append((halves[0], halves[1]))
    return out


def _rate(nbytes: int, per_run: list[list[float]], count: int) -> float | None:
    seconds = statistics.median(sum(run[:count]) for run in per_run)
    return nbytes / seconds / 1e9 if seconds > 0 else None


def ssd_read_rates(codec: str, chunks: list[torch.Tensor], counts: Sequence[int], layout: KVLayout,
                   fmt: KVFormat | None, root: str, runs: int) -> tuple[dict[int, float], bool]:
    """Raw GB/s of reading the first ``count`` of ``chunks`` back from a DiskTier with
    ``codec`` (median of ``runs``), per count; and whether the tier used O_DIRECT."""
    path = os.path.join(root, codec)
    capacity = len(chunks) * (layout.chunk_bytes + (1 << 20)) + (64 << 20)
    tier = DiskTier(DiskTierConfig(path, capacity, codec=codec))
    try:
        keys = [ChunkKey(i.to_bytes(KEY_BYTES, "big")) for i in range(1, len(chunks) + 1)]
        for i, (key, raw) in enumerate(zip(keys, chunks)):
            if not tier.put(key, raw, layout.layer_bytes, position=i, fmt=fmt):
                raise RuntimeError(f"the SSD tier refused chunk {i} of the history")
        os.sync()
        times: list[list[float]] = []
        for _ in range(runs):
            per = []
            for key in keys:
                t0 = time.perf_counter()
                if tier.get(key) is None:
                    raise RuntimeError("the SSD tier missed a chunk it had just stored")
                per.append(time.perf_counter() - t0)
            times.append(per)
        rates = {n: _rate(n * layout.chunk_bytes, times, n) or math.inf for n in counts}
        return rates, tier.direct_io
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
