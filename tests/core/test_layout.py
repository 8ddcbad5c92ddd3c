import pytest

from kvtier.core.layout import KVLayout


def test_byte_sizes_are_layer_major():
    lay = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, dtype="float16", chunk_tokens=16)
    assert lay.tensor_shape == (4, 16, 8)
    assert lay.tensor_bytes == 4 * 16 * 8 * 2
    assert lay.layer_bytes == 2 * lay.tensor_bytes
    assert lay.chunk_bytes == 3 * lay.layer_bytes
    assert [lay.layer_offset(i) for i in range(3)] == [0, lay.layer_bytes, 2 * lay.layer_bytes]
    assert lay.bytes_for_tokens(32) == 2 * lay.chunk_bytes
    with pytest.raises(IndexError, match="layer 3"):
        lay.layer_offset(3)


def test_mla_layout_has_one_tensor_per_layer():
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=576, dtype="bfloat16", kv=1)
    assert lay.layer_bytes == 256 * 576 * 2


def test_fingerprint_changes_with_every_field():
    base = KVLayout(2, 2, 8)
    variants = [
        KVLayout(3, 2, 8), KVLayout(2, 4, 8), KVLayout(2, 2, 16), KVLayout(2, 2, 8, "float32"),
        KVLayout(2, 2, 8, chunk_tokens=128), KVLayout(2, 2, 8, kv=1),
    ]
    prints = {v.fingerprint for v in variants}
    assert base.fingerprint not in prints and len(prints) == len(variants)
    assert KVLayout(2, 2, 8).fingerprint == base.fingerprint


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_layers=0, num_kv_heads=2, head_dim=8), "num_layers"),
        (dict(num_layers=2, num_kv_heads=-1, head_dim=8), "num_kv_heads"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8.0), "head_dim"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype="int8"), "dtype"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8, kv=3), "kv"),
        (dict(num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=0), "chunk_tokens"),
    ],
)
def test_bad_layouts_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        KVLayout(**kwargs)
