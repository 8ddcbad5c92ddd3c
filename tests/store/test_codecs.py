"""The store with a compressed SSD tier, told as stories: chunks demoted to SSD come back within
the codec's bound, layer by layer too; a restart with another codec reads them; damage is a miss."""

from __future__ import annotations

import torch

from kvtier import DiskTierConfig, HostTierConfig, KVStore, StoreConfig
from kvtier.core.layout import KVLayout
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.codecs import error_bound

from ..conftest import make_kv

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=64)
C = LAYOUT.chunk_tokens


def store_of(path, codec: str, host_chunks: int = 2) -> KVStore:
    return KVStore(StoreConfig(model="tiny@codecs", layout=LAYOUT,
                               host=HostTierConfig(host_chunks * LAYOUT.chunk_bytes),
                               disk=DiskTierConfig(str(path), 64 << 20, codec=codec)))


def assert_within(loaded, kv, tokens: int, codec: str) -> None:
    fmt = KVFormat.of_layout(LAYOUT)
    for (gk, gv), (k, v) in zip(loaded, kv):
        for i in range(tokens // C):
            sl = slice(i * C, (i + 1) * C)
            want = torch.stack([k[:, sl], v[:, sl]]).contiguous()
            got = torch.stack([gk[:, sl], gv[:, sl]])
            bound = error_bound(codec, want.view(-1).view(torch.uint8), fmt).view_as(want)
            assert bool(((got - want).abs() <= bound).all())


def test_chunks_demoted_to_a_compressed_ssd_come_back_within_the_codec_bound(tmp_path):
    tokens = list(range(6 * C))
    kv = make_kv(LAYOUT, len(tokens), seed=4)
    with store_of(tmp_path, "int8") as store:
        assert store.save(tokens, kv).stored == 6  # DRAM holds 2: four go down to SSD, compressed
        disk = store.tiers[1]
        assert store.flush() and len(disk.keys()) >= 4
        assert {disk.codec_of(k) for k in disk.keys()} == {"int8"}
        assert disk.used < 0.35 * len(disk.keys()) * LAYOUT.chunk_bytes  # float32 -> int8, plus a 4 KiB header each
        hit = store.lookup(tokens)
        assert hit.hit_tokens == 6 * C and "disk" in hit.tiers
        layerwise = store.load(hit, promote=False)  # one layer of every chunk at a time: one frame each
        assert layerwise.tokens == 6 * C
        assert_within(layerwise.kv, kv, 6 * C, "int8")
        promoted = store.load(store.lookup(tokens))
        assert_within(promoted.kv, kv, 6 * C, "int8")
        in_dram = [i for i, t in enumerate(hit.tiers) if t == "host"]
        for i in in_dram:  # what never left DRAM is exact
            for (gk, _), (k, _) in zip(promoted.kv, kv):
                assert torch.equal(gk[:, i * C : (i + 1) * C], k[:, i * C : (i + 1) * C])


def test_a_store_reopened_without_a_codec_reads_the_compressed_chunks(tmp_path):
    tokens = list(range(4 * C))
    kv = make_kv(LAYOUT, len(tokens), seed=5)
    with store_of(tmp_path, "int4", host_chunks=1) as store:
        store.save(tokens, kv)
        assert store.flush()
    with store_of(tmp_path, "none", host_chunks=4) as store:  # a restart: DRAM is empty
        hit = store.lookup(tokens)
        assert hit.tiers.count("disk") >= 3
        loaded = store.load(hit)
        assert loaded.tokens == hit.hit_tokens
        assert_within(loaded.kv, kv, hit.hit_tokens, "int4")


def test_a_damaged_compressed_chunk_is_a_miss_and_its_followers_are_not_loaded(tmp_path):
    tokens = list(range(4 * C))
    with store_of(tmp_path, "int8", host_chunks=1) as store:
        store.save(tokens, make_kv(LAYOUT, len(tokens), seed=6))
        assert store.flush()
        disk = store.tiers[1]
        first = store.keys_for(tokens)[0]
        assert disk.codec_of(first) == "int8"
        with open(disk._path(first), "r+b") as f:
            f.seek(8192)
            b = f.read(1)
            f.seek(8192)
            f.write(bytes([b[0] ^ 0xFF]))
        assert not store.host.contains(first)  # DRAM holds only the last chunk
        hit = store.lookup(tokens)
        loaded = store.load(hit)
        assert loaded.tokens == 0  # the first chunk is gone: nothing after it can be used
        assert disk.stats.corrupt == 1


def test_a_chunk_promoted_from_the_compressed_ssd_keeps_its_format_for_the_way_down(tmp_path):
    tokens = list(range(3 * C))
    with store_of(tmp_path, "int8", host_chunks=1) as store:
        store.save(tokens, make_kv(LAYOUT, len(tokens), seed=8))
        assert store.flush()
    with store_of(tmp_path, "int8", host_chunks=3) as store:  # reopened: the format is in the header
        first = store.keys_for(tokens)[0]
        disk = store.tiers[1]
        assert disk.format_of(first) == KVFormat.of_layout(LAYOUT)
        assert store.load(store.lookup(tokens)).tokens >= C
        assert store.host.contains(first) and store.host.format_of(first) == KVFormat.of_layout(LAYOUT)
