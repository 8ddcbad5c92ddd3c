"""The SSD tier through a codec: smaller files, raw bytes out (within the codec's bound), any
codec read by any tier, damage a counted miss."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.codecs import error_bound, frame_bytes
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.disk_format import header_len_for

FMT = KVFormat("float32", 32, 2)
LAYERS = 4
SEG = 2 * 2 * 64 * 32 * 4  # K and V, 2 heads x 64 tokens x 32 dims, float32: 32 KiB a layer


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def chunk(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return (torch.randn(LAYERS * SEG // 4, generator=g) * 3).view(torch.uint8)


def open_tier(path, codec="none", **kw) -> DiskTier:
    return DiskTier(DiskTierConfig(str(path), 64 << 20, codec=codec, **kw))


def within_bound(got: torch.Tensor, raw: torch.Tensor, codec: str) -> bool:
    for layer in range(LAYERS):
        part = raw[layer * SEG : (layer + 1) * SEG]
        err = (got[layer * SEG : (layer + 1) * SEG].view(torch.float32) - part.view(torch.float32)).abs()
        if not bool((err.view(2, -1, 32) <= error_bound(codec, part, FMT)).all()):
            return False
    return True


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_kv_goes_down_compressed_and_comes_back_raw_within_the_codec_bound(tmp_path, codec):
    with open_tier(tmp_path, codec) as tier:
        raw = chunk(1)
        assert tier.put(key(1), raw, SEG, fmt=FMT)
        assert tier.codec_of(key(1)) == codec
        assert tier.entry_bytes(key(1)) == raw.numel() and tier.segment_bytes_of(key(1)) == SEG
        stored = header_len_for(LAYERS, coded=True) + -(-frame_bytes(codec, SEG, FMT) * LAYERS // 4096) * 4096
        assert tier.used == stored < 0.6 * raw.numel()
        got = tier.get(key(1))
        assert got.numel() == raw.numel() and not torch.equal(got, raw) and within_bound(got, raw, codec)
        # one layer alone decodes one frame, into the caller's buffer
        out = torch.empty(SEG, dtype=torch.uint8)
        assert tier.get(key(1), out=out, offset=2 * SEG, length=SEG) is out
        assert torch.equal(out, got[2 * SEG : 3 * SEG])
        # a range inside a layer
        assert torch.equal(tier.get(key(1), offset=SEG + 100, length=5000), got[SEG + 100 : SEG + 5100])
        assert tier.stats.bytes_read == raw.numel() + SEG + 5000  # counted in raw bytes
        assert tier.stats.lossy_hits == 3


def test_what_is_not_kv_or_cannot_be_framed_is_stored_raw(tmp_path):
    with open_tier(tmp_path, "int8") as tier:
        raw = chunk(2)
        assert tier.put(key(1), raw, SEG)  # no format: not known to be KV (an encoder output, say)
        assert tier.codec_of(key(1)) == "none" and torch.equal(tier.get(key(1)), raw)
        odd = raw[: SEG - 4]
        assert tier.put(key(2), odd, fmt=FMT)  # not whole rows
        assert tier.codec_of(key(2)) == "none" and torch.equal(tier.get(key(2)), odd)
        nan = raw.clone().view(torch.float32)
        nan[3] = float("nan")
        assert tier.put(key(3), nan.view(torch.uint8), SEG, fmt=FMT)
        assert tier.codec_of(key(3)) == "none" and torch.equal(tier.get(key(3)), nan.view(torch.uint8))


def test_chunks_of_one_codec_are_read_by_a_tier_configured_with_another_after_a_restart(tmp_path):
    raw = chunk(3)
    with open_tier(tmp_path, "int4") as tier:
        tier.put(key(1), raw, SEG, fmt=FMT)
        compressed = tier.get(key(1))
    with open_tier(tmp_path, "none") as tier:  # reopened raw: it still reads the int4 chunk
        assert tier.codec_of(key(1)) == "int4" and torch.equal(tier.get(key(1)), compressed)
        tier.put(key(2), raw, SEG, fmt=FMT)
        assert tier.codec_of(key(2)) == "none"
    with open_tier(tmp_path, "int8") as tier:
        assert torch.equal(tier.get(key(2)), raw) and torch.equal(tier.get(key(1)), compressed)


def test_a_corrupted_compressed_chunk_is_a_counted_miss_and_the_rest_survives(tmp_path, caplog):
    with open_tier(tmp_path, "int8") as tier:
        tier.put(key(1), chunk(1), SEG, fmt=FMT)
        tier.put(key(2), chunk(2), SEG, fmt=FMT)
        good = tier.get(key(1), offset=0, length=SEG)
        path = tier._path(key(1))
        frame = frame_bytes("int8", SEG, FMT)
        with open(path, "r+b") as f:  # one byte of the third frame's quantized elements
            pos = header_len_for(LAYERS, coded=True) + 2 * frame + 100
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x10]))
        assert torch.equal(tier.get(key(1), offset=0, length=SEG), good)  # frame 0 still verifies
        assert tier.get(key(1)) is None
        assert tier.stats.corrupt == 1 and tier.stats.misses == 1
        assert "checksum mismatch in segment 2" in caplog.text
        assert tier.flush_deletes() and not os.path.exists(path)
        assert tier.get(key(2)) is not None


def test_a_damaged_coded_header_drops_the_file_at_open(tmp_path):
    with open_tier(tmp_path, "int8") as tier:
        tier.put(key(1), chunk(1), SEG, fmt=FMT)
        path = tier._path(key(1))
    with open(path, "r+b") as f:  # the raw size field of the version 3 header
        f.seek(64)
        b = f.read(1)
        f.seek(64)
        f.write(bytes([b[0] ^ 0x01]))
    with open_tier(tmp_path) as tier:
        assert not tier.contains(key(1)) and tier.stats.corrupt == 1


def test_auto_measures_the_disk_and_picks_within_the_budget(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvtier")
    with open_tier(tmp_path / "a", "auto", max_kl=0.0) as tier:
        assert tier.codec == "none"  # nothing lossy fits a zero budget
    with open_tier(tmp_path / "b", "auto") as tier:
        assert tier.codec in ("none", "fp8", "int8", "int4")
    assert "codec auto chose" in caplog.text and "GB/s" in caplog.text


def test_bad_codec_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="disk: codec must be one of"):
        DiskTierConfig(str(tmp_path), 1 << 20, codec="zstd")
    with pytest.raises(ValueError, match="max_kl"):
        DiskTierConfig(str(tmp_path), 1 << 20, codec="auto", max_kl=-1)
