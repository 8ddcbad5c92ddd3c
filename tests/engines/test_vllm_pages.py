"""Each page adapter on tensors in its own backend's layout: pages go out and back exactly, and
what is stored matches an independent reference written out index by index."""

from __future__ import annotations

import pytest
import torch

from kvtier.core.layout import KVLayout
from kvtier.engines.vllm.pages import ADAPTERS, adapter_for, page_format

BLOCKS, BS = 12, 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=3, head_dim=8, dtype="float32", chunk_tokens=2 * BS)
MLA_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=24, dtype="float32", chunk_tokens=2 * BS, kv=1)


def reference_page(backend: str, kv: torch.Tensor, b: int) -> torch.Tensor:
    """Block ``b``'s page written out by hand, in the backend's element order."""
    if backend == "CPU_ATTN":  # [blocks, heads, block, 2*dim]
        return torch.stack([kv[b, h] for h in range(kv.shape[1])])
    if backend == "FLASH_ATTN":  # [2, blocks, block, heads, dim]: K page then V page
        return torch.stack([kv[0, b], kv[1, b]])
    if backend in ("FLASHINFER", "TRITON_ATTN"):  # [blocks, 2, block, heads, dim]
        return torch.stack([kv[b, 0], kv[b, 1]])
    return torch.stack([kv[b, t] for t in range(kv.shape[1])])  # MLA: [blocks, block, latent]


CASES = [(name, LAYOUT) for name in ADAPTERS] + [("FLASHMLA", MLA_LAYOUT)]


@pytest.mark.parametrize(("backend", "layout"), CASES)
def test_pages_round_trip_exactly_and_match_a_reference(backend, layout):
    a = adapter_for(backend)
    shape = a.shape(BLOCKS, BS, layout)
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    a.check(kv, BLOCKS, BS, layout)
    assert a.page_bytes(kv) * 2 == layout.layer_bytes  # two blocks a chunk
    ids = torch.tensor([7, 2])
    stored = torch.empty(layout.layer_bytes, dtype=torch.uint8)
    a.pages(stored, kv, 2).copy_(a.gather(kv, ids))
    pages = stored.view(torch.float32).view(2, -1)
    for j, b in enumerate((7, 2)):
        assert torch.equal(pages[j], reference_page(backend, kv, b).flatten())
    out = torch.zeros_like(kv)
    a.scatter(out, torch.tensor([3, 9]), a.pages(stored, kv, 2))
    for src, dst in ((7, 3), (2, 9)):
        assert torch.equal(reference_page(backend, out, dst), reference_page(backend, kv, src))
    untouched = [b for b in range(BLOCKS) if b not in (3, 9)]
    assert all(torch.count_nonzero(reference_page(backend, out, b)) == 0 for b in untouched)


def test_a_tensor_not_in_the_adapters_layout_is_refused_naming_both():
    kv = torch.zeros(BLOCKS, LAYOUT.num_kv_heads, BS, 2 * LAYOUT.head_dim)  # the CPU layout
    with pytest.raises(ValueError, match=r"FLASH_ATTN.*\(2, 12, 4, 3, 8\).*\(12, 3, 4, 16\)"):
        adapter_for("FLASH_ATTN").check(kv, BLOCKS, BS, LAYOUT)
    with pytest.raises(ValueError, match="dtype"):
        adapter_for("CPU_ATTN").check(kv.half(), BLOCKS, BS, LAYOUT)


def test_an_unknown_backend_is_named_and_formats_differ_per_backend_and_shard():
    with pytest.raises(ValueError, match="no page adapter.*'SOMETHING_NEW'"):
        adapter_for("SOMETHING_NEW")
    formats = {page_format(b, "float32", 16) for b in ADAPTERS} | {page_format("CPU_ATTN", "float32", 16, 1, 2)}
    assert len(formats) == len(ADAPTERS) + 1


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASHINFER", "FLASH_ATTN"])
def test_a_save_copies_straight_into_the_slot_when_the_block_dim_is_first(backend):
    from kvtier.engines.vllm.copies import Copier

    a = adapter_for(backend)
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32", chunk_tokens=8)
    kv = torch.randn(a.shape(6, 4, lay))
    ids = torch.tensor([4, 1])
    slot = torch.zeros(2 * a.page_bytes(kv), dtype=torch.uint8)
    dst = a.pages(slot, kv, 2)
    Copier(kv.device, 1).save_pages(dst, kv, a, ids)
    assert torch.equal(dst, a.gather(kv, ids))  # the same bytes as a gather and a copy
    assert a.gather_into(kv, ids, dst) == (a.block_dim == 0)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASHINFER", "FLASH_ATTN"])
def test_a_slot_of_the_wrong_shape_is_refused_not_resized(backend):
    a = adapter_for(backend)
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, dtype="float32", chunk_tokens=8)
    kv = torch.randn(a.shape(6, 4, lay))
    if a.block_dim != 0:
        pytest.skip("this backend's pages are gathered, then copied")
    slot = torch.zeros(3 * a.page_bytes(kv), dtype=torch.uint8)
    dst = a.pages(slot, kv, 3)  # three pages of room, two pages asked for
    with pytest.raises(ValueError, match="do not fit the slot"):
        a.gather_into(kv, torch.tensor([4, 1]), dst)
    assert not dst.any()  # nothing written
