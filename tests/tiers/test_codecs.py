"""The KV codecs: every codec round-trips within its stated bound, frames are self-describing,
and what cannot be framed is refused (the tier then stores it raw)."""

from __future__ import annotations

import pytest
import torch

from kvtier.core.codec_choice import CodecFigures, choose_codec
from kvtier.tiers.codec_types import CodecError, KVFormat
from kvtier.tiers.codecs import (
    bytes_ratio,
    decode,
    encode,
    error_bound,
    frame_bytes,
    read_header,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_segment(dtype: str, heads: int = 3, tokens: int = 256, head_dim: int = 64, kv: int = 2,
               seed: int = 0) -> torch.Tensor:
    """One layer of one chunk as the store lays it out, with the outlier channels real keys have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(kv, heads, tokens, head_dim, generator=gen) * torch.linspace(0.05, 3.0, head_dim)
    x[0, :, :, 7] += 25.0  # an outlier key channel
    return x.to(DTYPES[dtype]).contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("kv", [1, 2])
def test_every_codec_round_trips_within_its_bound(codec, dtype, kv):
    fmt = KVFormat(dtype, 64, kv)
    raw = kv_segment(dtype, kv=kv)
    frame = encode(codec, raw, fmt)
    assert frame.numel() == frame_bytes(codec, raw.numel(), fmt)
    back = decode(frame)
    assert back.numel() == raw.numel()
    x = raw.view(DTYPES[dtype]).float().view(kv, -1, 64)
    err = (back.view(DTYPES[dtype]).float().view(kv, -1, 64) - x).abs()
    assert bool((err <= error_bound(codec, raw, fmt)).all())
    assert float(err.max()) > 0  # lossy for real: a bound that is never approached tests nothing
    info = read_header(frame)
    assert (info.codec, info.fmt, info.raw_bytes) == (codec, fmt, raw.numel())


def test_keys_per_channel_keep_an_outlier_channel_from_swamping_the_others():
    fmt = KVFormat("float32", 64, 2)
    raw = kv_segment("float32")
    x = raw.view(torch.float32).view(2, -1, 64)
    back = decode(encode("int4", raw, fmt)).view(torch.float32).view(2, -1, 64)
    quiet = (back[0, :, :8] - x[0, :, :8]).abs().mean()  # small channels beside the outlier (7)
    assert quiet < 0.05 * x[0, :, 7].abs().mean()


def test_sizes_match_what_the_issue_asks_of_each_codec():
    fmt = KVFormat("bfloat16", 64, 2)
    seg = kv_segment("bfloat16").numel()
    assert bytes_ratio("int8", fmt, seg) <= 0.53
    assert bytes_ratio("int4", fmt, seg) <= 0.29
    assert bytes_ratio("fp8", fmt, seg) <= 0.53
    assert bytes_ratio("none", KVFormat("float32", 64), seg) == 2.0


def test_a_frame_decodes_into_a_given_buffer_and_refuses_one_of_another_size():
    fmt = KVFormat("float16", 64, 2)
    raw = kv_segment("float16")
    frame = encode("int8", raw, fmt)
    out = torch.empty_like(raw)
    assert decode(frame, out=out) is out
    assert torch.equal(out, decode(frame))
    with pytest.raises(CodecError, match="raw bytes read into"):
        decode(frame, out=torch.empty(raw.numel() - 2, dtype=torch.uint8))


def test_damaged_frames_are_refused_never_decoded_into_wrong_bytes():
    fmt = KVFormat("float32", 64, 2)
    frame = encode("int8", kv_segment("float32"), fmt)
    bad_magic = frame.clone()
    bad_magic[0] ^= 0xFF
    with pytest.raises(CodecError, match="not a KV codec frame"):
        decode(bad_magic)
    with pytest.raises(CodecError, match="wrong size"):
        decode(frame[:-1])
    bad_size = frame.clone()
    bad_size[12] ^= 0x01  # raw_bytes in the header
    with pytest.raises(CodecError):
        decode(bad_size)


def test_what_cannot_be_framed_is_refused_with_the_reason():
    fmt = KVFormat("float32", 64, 2)
    raw = kv_segment("float32")
    x = raw.view(torch.float32).clone()
    x[5] = float("nan")
    with pytest.raises(CodecError, match="non-finite"):
        encode("int8", x.view(torch.uint8), fmt)
    with pytest.raises(CodecError, match="whole rows"):
        encode("int8", raw[:-4], fmt)
    with pytest.raises(CodecError, match="even"):
        encode("int4", torch.zeros(2 * 1 * 3 * 4, dtype=torch.uint8), KVFormat("float32", 3, 2))
    with pytest.raises(ValueError, match="KV, not 'int32'"):
        KVFormat("int32", 64)


def test_auto_takes_the_fastest_load_within_the_quality_budget():
    figs = [CodecFigures("int8", 0.5, 8e9, 0.0001), CodecFigures("int4", 0.27, 5e9, 0.02),
            CodecFigures("fp8", 0.5, 1e9, 0.003)]
    assert choose_codec(figs, read_Bps=1.5e9, max_kl=0.005) == "int8"
    assert choose_codec(figs, read_Bps=1.5e9, max_kl=0.05) == "int4"
    assert choose_codec(figs, read_Bps=1.5e9, max_kl=0.0) == "none"  # a zero budget keeps KV exact
    assert choose_codec(figs, read_Bps=100e9, max_kl=0.05) == "none"  # decoding would cost more than it saves
    with pytest.raises(ValueError, match="bandwidth"):
        choose_codec(figs, read_Bps=0, max_kl=0.01)


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_values_at_the_edges_of_their_dtype_come_back_finite_and_within_bound(codec):
    fmt = KVFormat("float16", 64, 2)
    x = kv_segment("float16").view(torch.float16).clone()
    x[:64] = 65504.0  # a row at float16's largest value: a step rounded up must not make inf
    x[64:128] = -65504.0
    x[5000:5064] = 1e-5  # a tiny row: float16 scales are subnormal there
    raw = x.view(torch.uint8)
    back = decode(encode(codec, raw, fmt)).view(torch.float16)
    assert bool(torch.isfinite(back).all())
    err = (back.float() - x.float()).abs().view(2, -1, 64)
    assert bool((err <= error_bound(codec, raw, fmt)).all())


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_odd_sizes_and_misaligned_buffers_decode(codec):
    fmt = KVFormat("float32", 5, 1)  # 3 rows of 5: an odd element count before the scales
    raw = torch.randn(15).view(torch.uint8)
    frame = encode(codec, raw, fmt)
    store = torch.zeros(frame.numel() + 1, dtype=torch.uint8)
    store[1:] = frame  # the frame at an odd offset, as in a staging buffer
    out = torch.zeros(raw.numel() + 1, dtype=torch.uint8)
    got = decode(store[1:], out=out[1:])  # and the raw bytes to an odd offset
    assert torch.equal(got, decode(frame))
    err = (got.clone().view(torch.float32) - raw.view(torch.float32)).abs()
    assert bool((err <= error_bound(codec, raw, fmt).view(-1)).all())

