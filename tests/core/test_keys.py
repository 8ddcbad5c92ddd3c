import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.keys import KEY_BYTES, Namespace, chunk_tokens_of, to_token_array

NS = Namespace(model="llama@rev1", layout="abcd")


def keys(tokens, ns=NS, chunk=4):
    return chunk_tokens_of(tokens, ns, chunk).keys


def test_only_full_chunks_get_keys():
    chunks = chunk_tokens_of(list(range(10)), NS, 4)
    assert len(chunks.keys) == 2
    assert chunks.covered_tokens == 8
    assert chunks.num_tokens == 10
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in chunks.keys)


def test_shared_prefix_shares_chunks_and_divergence_breaks_the_chain():
    a = list(range(16))
    b = list(range(8)) + [99] + list(range(9, 16))
    ka, kb = keys(a), keys(b)
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2]
    # chunk 3 has identical tokens in both, but its prefix differs, so its key differs
    assert ka[3] != kb[3]


def test_same_tokens_in_another_chunk_position_differ():
    assert keys([1, 2, 3, 4, 1, 2, 3, 4])[0] != keys([1, 2, 3, 4, 1, 2, 3, 4])[1]


def test_namespace_separates_models_layouts_and_tenants():
    toks = list(range(8))
    base = keys(toks)
    assert keys(toks, Namespace("llama@rev2", "abcd")) != base
    assert keys(toks, Namespace("llama@rev1", "abce")) != base
    assert keys(toks, NS.with_tenant("acme")) != base
    assert keys(toks, NS.with_tenant("acme")) == keys(toks, Namespace("llama@rev1", "abcd", "acme"))


def test_namespace_fields_cannot_collide_by_concatenation():
    assert Namespace("ab", "c").digest != Namespace("a", "bc").digest


def test_list_numpy_and_torch_inputs_give_identical_keys():
    toks = list(range(1000, 1032))
    expected = keys(toks)
    assert keys(np.array(toks, dtype=np.int32)) == expected
    assert keys(np.array(toks, dtype=np.uint16)) == expected
    assert keys(torch.tensor(toks)) == expected


def test_keys_are_stable_across_processes_and_versions():
    # A golden value: changing it orphans every chunk users have on disk.
    k = keys(list(range(8)))[1].hex()
    code = (
        "from kvtier.core.keys import Namespace, chunk_tokens_of;"
        "print(chunk_tokens_of(list(range(8)), Namespace('llama@rev1','abcd'), 4).keys[1].hex())"
    )
    for _ in range(2):  # separate processes: separate hash() salts
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == k
    assert k == GOLDEN


GOLDEN = "d1aa788c90ef543d8c2ec6f2b91b12e6"


@pytest.mark.parametrize(
    "bad, exc, words",
    [
        ([1, 2.5, 3], TypeError, "float"),
        (["a", "b"], TypeError, "str"),
        ("hello", TypeError, "str"),
        ([1, -2, 3], ValueError, "non-negative"),
        (np.zeros((2, 4), dtype=np.int64), ValueError, "1-D"),
        (np.array([0.5, 1.0]), TypeError, "float64"),
        (torch.tensor([1.0, 2.0]), TypeError, "float"),
        (torch.tensor([True, False]), TypeError, "bool"),
        (np.array([True, False]), TypeError, "bool"),
        ([True, False, True], TypeError, "bool"),  # array('q') took them as 1, 0, 1
        ([5, np.bool_(True)], TypeError, "bool"),
        (42, TypeError, "int"),
        ([1, 2**70], ValueError, "range"),
    ],
)
def test_bad_tokens_raise_naming_the_problem(bad, exc, words):
    with pytest.raises(exc, match=words):
        to_token_array(bad)


@pytest.mark.parametrize("extras, words", [
    ([b"cat"], "mapping of chunk index to bytes"),  # was an AttributeError on .get
    ({0: "cat"}, r"extras\[0\] must be bytes"),
    ({"0": b"cat"}, "chunk index"),
    ({-1: b"cat"}, "chunk index"),
])
def test_bad_extras_raise_naming_the_problem(extras, words):
    with pytest.raises(TypeError, match=words):
        chunk_tokens_of(list(range(32)), NS, 16, extras)


def test_bad_chunk_size_and_namespace():
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_tokens_of([1, 2], NS, 0)
    with pytest.raises(ValueError, match="model"):
        Namespace("", "abcd")
    # a tenant is stored with each of its chunks (SSD header): one too long for it is refused
    # up front, not found out when a demotion to SSD fails
    Namespace("m", "abcd", "é" * 256)
    with pytest.raises(ValueError, match="at most 512 bytes"):
        Namespace("m", "abcd", "é" * 257)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**31), max_size=64), st.integers(1, 8), st.integers(0, 64))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens, chunk, cut):
    full = keys(tokens, chunk=chunk)
    assert keys(tokens[:cut], chunk=chunk) == full[: min(cut, len(tokens)) // chunk]


def test_images_in_a_chunk_change_its_key_and_every_later_one():
    from kvtier.core.keys import image_extras

    ns = Namespace("vlm@1", "layout")
    tokens = list(range(64))  # 4 chunks of 16; an image's placeholders at tokens 20..40
    plain = chunk_tokens_of(tokens, ns, 16).keys
    cat = chunk_tokens_of(tokens, ns, 16, image_extras([(20, 40, "cat")], 16)).keys
    dog = chunk_tokens_of(tokens, ns, 16, image_extras([(20, 40, "dog")], 16)).keys
    assert cat[0] == dog[0] == plain[0]  # before the image: shared
    assert all(c != d for c, d in zip(cat[1:], dog[1:]))  # from the image's first chunk on: not
    assert all(c != p for c, p in zip(cat[1:], plain[1:]))
    assert cat == chunk_tokens_of(tokens, ns, 16, image_extras([(20, 40, "cat")], 16)).keys
    assert image_extras([(20, 40, "cat")], 16) == {1: b"cat", 2: b"cat"}
    with pytest.raises(ValueError, match="start < end"):
        image_extras([(5, 5, "x")], 16)
