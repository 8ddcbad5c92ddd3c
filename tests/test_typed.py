"""Typed objects in the store's tiers, told as stories: an encoder output and an index shard
share DRAM with KV, go down to SSD and come back byte for byte, and a damaged part is a miss."""

import pytest
import torch

from kvtier.core.objects import ObjectKind, content_hash, object_key, part_keys
from kvtier.typed import TypedObjects

from .conftest import make_kv
from .store.test_facade import C, store_of


def blob(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_keys_name_the_kind_and_the_content():
    image = b"\x89PNG fake image bytes"
    enc = object_key(ObjectKind.ENCODER_OUTPUT, content_hash(image), "clip@1")
    assert enc == object_key(ObjectKind.ENCODER_OUTPUT, content_hash(image), "clip@1")
    assert enc != object_key(ObjectKind.ENCODER_OUTPUT, content_hash(image + b"!"), "clip@1")
    assert enc != object_key(ObjectKind.ENCODER_OUTPUT, content_hash(image), "clip@2")
    assert enc != object_key(ObjectKind.BLOB, content_hash(image), "clip@1")
    assert enc != object_key(ObjectKind.ENCODER_OUTPUT, content_hash(image), "clip@1", tenant="t")
    assert object_key(ObjectKind.BLOB, "ab", "c") != object_key(ObjectKind.BLOB, "a", "bc")
    with pytest.raises(ValueError, match="identifying part"):
        object_key(ObjectKind.BLOB)


def test_an_object_larger_than_a_slot_goes_through_dram_and_ssd_whole(layout, tmp_path):
    data = blob(3 * layout.chunk_bytes + 123)
    key = object_key(ObjectKind.INDEX_SHARD, "user-7", "v3")
    with store_of(layout, host_chunks=6, disk_path=tmp_path) as store:
        objects = TypedObjects(store)
        assert objects.put(key, data, ObjectKind.INDEX_SHARD, recompute_s=2.0)
        hit = objects.get(key)
        assert torch.equal(hit.data, data) and hit.tier == "host"
        assert hit.header.kind is ObjectKind.INDEX_SHARD and hit.header.recompute_s == 2.0
        # KV traffic pushes the object's 4 parts down to SSD; it comes back whole
        store.save(list(range(6 * C)), make_kv(layout, 6 * C))
        assert store.lookup(list(range(6 * C))).hit_tokens == 6 * C
        hit = objects.get(key)
        assert torch.equal(hit.data, data) and hit.tier == "disk"
        assert objects.get(key).tier == "host"  # promoted
        assert objects.stats.hits["INDEX_SHARD"] == 3 and objects.stats.misses == 0


def test_a_damaged_or_missing_part_is_a_miss_never_a_partial_object(layout, tmp_path):
    data = blob(2 * layout.chunk_bytes)
    key = object_key(ObjectKind.BLOB, "doc", "1")
    with store_of(layout, host_chunks=4, disk_path=tmp_path) as store:
        objects = TypedObjects(store)
        objects.put(key, data, ObjectKind.BLOB, recompute_s=0.5)
        parts = part_keys(key, data.numel(), layout.chunk_bytes)
        assert len(parts) == 3
        store.cache.forget(parts[2])  # as if the last part were lost
        assert objects.get(key) is None and objects.stats.misses == 1
        assert objects.put(key, data, ObjectKind.BLOB, recompute_s=0.5)  # rebuilt: whole again
        assert torch.equal(objects.get(key).data, data)


def test_bad_arguments_are_refused(layout):
    with store_of(layout, host_chunks=2) as store:
        objects = TypedObjects(store)
        key = object_key(ObjectKind.BLOB, "x")
        with pytest.raises(ValueError, match="non-KV ObjectKind"):
            objects.put(key, b"abc", ObjectKind.KV, 1.0)
        with pytest.raises(ValueError, match="recompute_s"):
            objects.put(key, b"abc", ObjectKind.BLOB, -1.0)
        with pytest.raises(ValueError, match="does not fit in the DRAM tier"):
            objects.put(key, blob(10 * layout.chunk_bytes), ObjectKind.BLOB, 1.0)
        other = object_key(ObjectKind.BLOB, "y")
        assert objects.put(other, blob(layout.chunk_bytes - 100), ObjectKind.BLOB, 1.0)
        with store.host.pinned(other):  # DRAM: one slot pinned, one free: 2 parts cannot fit
            assert not objects.put(key, blob(layout.chunk_bytes + 100), ObjectKind.BLOB, 1.0)
        assert objects.stats.refused["BLOB"] == 1 and objects.get(key) is None
        assert store.snapshot()["tiers"]["host"]["chunks"] == 1  # no orphan part left behind
