"""The quantizers of the KV codecs (:mod:`kvtier.tiers.codecs`): float32 rows in, quantized
elements and float16 scales out (a scale per row, or per channel over a group of rows), and
back."""

from __future__ import annotations

import torch

from kvtier.tiers.codec_types import CodecError

GROUP_ROWS = 128
"""Rows sharing one K scale per channel (KIVI's group; 256-token chunks hold two per head)."""
FP8_MAX = 448.0
_F16_MAX = 65504.0
_F16_TINY = 2.0**-24


def _group(rows: int) -> int:
    return min(GROUP_ROWS, rows)


def _f16(t: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(t).all()) or float(t.abs().max()) > _F16_MAX:
        raise CodecError("KV scales beyond float16 (non-finite or huge values): stored raw")
    return t.to(torch.float16)


def _step(amax: torch.Tensor, levels: float) -> torch.Tensor:
    """A float16 step with ``levels`` steps reaching ``amax`` (rounded up, never down: a step
    rounded down would clip the largest values, tiny ones most, where float16 is subnormal)."""
    step = _f16((amax / levels).clamp_min(_F16_TINY))
    short = step.float() * levels < amax
    return torch.where(short, torch.nextafter(step, torch.full_like(step, torch.inf)), step)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """[rows, d] -> [groups, group, d], the last group padded by repeating its last row (which
    changes no group's range)."""
    rows, d = x.shape
    pad = -rows % group
    if pad:
        x = torch.cat([x, x[-1:].expand(pad, d)])
    return x.view(-1, group, d)


def _q_int8(x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if per_channel:
        g = _grouped(x, _group(x.shape[0]))
        amax = g.abs().amax(dim=1)  # [groups, d]
        scale = _step(amax, 127.0)
        s = scale.float().repeat_interleave(g.shape[1], dim=0)[: x.shape[0]]
    else:
        scale = _step(x.abs().amax(dim=1), 127.0)  # [rows]
        s = scale.float()[:, None]
    q = torch.round(x / s).clamp_(-127, 127).to(torch.int8)
    return q.view(torch.uint8).reshape(-1), scale.view(torch.uint8).reshape(-1)


def _by_group(v: torch.Tensor, rows: int, d: int) -> tuple[torch.Tensor, int]:
    """``v`` ([rows, d]) as [groups, group, d] to broadcast per-group scales over, and how many
    rows of padding that needs (then the caller takes the first ``rows``)."""
    group = _group(rows)
    pad = -rows % group
    if pad:
        v = torch.cat([v, v.new_zeros(pad, d)])
    return v.view(-1, group, d), pad


def _dq_int8(q: torch.Tensor, scales: torch.Tensor, rows: int, d: int, per_channel: bool) -> torch.Tensor:
    v = q.view(torch.int8).view(rows, d).float()
    sc = scales.view(torch.float16).float()
    if per_channel:
        g, _ = _by_group(v, rows, d)
        return g.mul_(sc.view(-1, 1, d)).view(-1, d)[:rows]
    return v.mul_(sc[:, None])


def _q_int4(x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    if per_channel:
        g = _grouped(x, _group(rows))
        lo, hi = g.amin(dim=1), g.amax(dim=1)  # [groups, d]
    else:
        lo, hi = x.amin(dim=1), x.amax(dim=1)  # [rows]
    lo16 = _f16(lo)
    step = _f16(((hi - lo16.float()) / 15.0).clamp_min(_F16_TINY))
    # a step rounded down to float16 could leave the top of the range past 15 steps: nudge it up
    short = lo16.float() + 15.0 * step.float() < hi
    step = torch.where(short, torch.nextafter(step, torch.full_like(step, torch.inf)), step)
    if per_channel:
        group = _group(rows)
        lo_r = lo16.float().repeat_interleave(group, dim=0)[:rows]
        st_r = step.float().repeat_interleave(group, dim=0)[:rows]
    else:
        lo_r, st_r = lo16.float()[:, None], step.float()[:, None]
    q = torch.round((x - lo_r) / st_r).clamp_(0, 15).to(torch.uint8).reshape(-1)
    packed = q[0::2] | (q[1::2] << 4)
    scales = torch.cat([lo16.reshape(-1), step.reshape(-1)]).view(torch.uint8)
    return packed, scales


def _dq_int4(p: torch.Tensor, scales: torch.Tensor, rows: int, d: int, per_channel: bool) -> torch.Tensor:
    q = torch.empty(rows * d, dtype=torch.float32)
    q[0::2] = p & 0xF
    q[1::2] = p >> 4
    sc = scales.view(torch.float16).float()
    lo, step = sc.chunk(2)
    if per_channel:
        g, _ = _by_group(q.view(rows, d), rows, d)
        return g.mul_(step.view(-1, 1, d)).add_(lo.view(-1, 1, d)).view(-1, d)[:rows]
    return q.view(rows, d).mul_(step[:, None]).add_(lo[:, None])


def _q_fp8(x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _step(x.abs().amax(dim=1), FP8_MAX)  # per row, always
    q = (x / scale.float()[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).reshape(-1), scale.view(torch.uint8).reshape(-1)


def _dq_fp8(q: torch.Tensor, scales: torch.Tensor, rows: int, d: int, per_channel: bool) -> torch.Tensor:
    v = q.view(torch.float8_e4m3fn).view(rows, d).float()
    return v.mul_(scales.view(torch.float16).float()[:, None])


_QUANT = {"int8": (_q_int8, _dq_int8), "int4": (_q_int4, _dq_int4), "fp8": (_q_fp8, _dq_fp8)}
# fp8 keeps a scale per row for K too: e4m3's exponent already adapts to each element
