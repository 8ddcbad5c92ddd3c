"""vLLM's KV pages, one adapter per attention backend's page layout.

A vLLM KV cache is, per layer, one tensor holding every block ("page") of that layer. Where the
block dimension lies, and what a page holds, depends on the attention backend:

==============  ==================================  ==========
backend         per-layer tensor                    block dim
==============  ==================================  ==========
CPU_ATTN        ``[blocks, heads, block, 2*dim]``   0 (K then V inside a page; K transposed
                                                    inside the block on the fp32 path)
FLASH_ATTN      ``[2, blocks, block, heads, dim]``  1 (K pages, then V pages)
FLASHINFER      ``[blocks, 2, block, heads, dim]``  0
TRITON_ATTN     ``[blocks, 2, block, heads, dim]``  0
``*MLA*``       ``[blocks, block, latent]``         0 (one latent per token, no separate V)
==============  ==================================  ==========

kvtier stores one layer of a chunk as its pages in order, each page in the backend's own
element order (``[n, *page]``): a copy is one gather or scatter along the block dimension, and a
page means something only to its own backend -- so the adapter's name (backend, dtype, block
size, tensor-parallel shard) is part of the key namespace, and pages of different layouts never
match. The adapter is chosen from the backend vLLM's config selects (never guessed from a
tensor's sizes); :meth:`PageAdapter.check` then refuses a tensor that is not in its layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.core.layout import KVLayout


@dataclass(frozen=True)
class PageAdapter:
    """How one backend lays out a layer's KV tensor."""

    backend: str
    block_dim: int
    shape: Callable[[int, int, KVLayout], tuple[int, ...]]
    """(num_blocks, block_size, layout) -> the per-layer tensor's shape."""

    def check(self, kv: torch.Tensor, num_blocks: int, block_size: int, layout: KVLayout) -> None:
        """Raise ValueError naming the mismatch if ``kv`` is not a layer in this layout."""
        want = self.shape(num_blocks, block_size, layout)
        if tuple(kv.shape) != want:
            raise ValueError(f"{self.backend}: a layer's KV tensor should be {want} for {num_blocks} "
                             f"blocks of {block_size} tokens and {layout}, got {tuple(kv.shape)}")
        if str(kv.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"{self.backend}: KV tensor dtype {kv.dtype} is not the layout's {layout.dtype}")

    def page_bytes(self, kv: torch.Tensor) -> int:
        return kv.numel() // kv.shape[self.block_dim] * kv.element_size()

    def pages(self, chunk_layer: torch.Tensor, kv: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` pages stored in ``chunk_layer`` (a uint8 view of one layer of one chunk), as
        ``[count, *page]`` in ``kv``'s dtype."""
        page = [s for d, s in enumerate(kv.shape) if d != self.block_dim]
        n = count * self.page_bytes(kv)
        return chunk_layer[:n].view(kv.dtype).view(count, *page)

    def gather(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Pages ``block_ids`` of ``kv`` as ``[n, *page]`` (a new tensor)."""
        return kv.index_select(self.block_dim, block_ids).movedim(self.block_dim, 0)

    def gather_into(self, kv: torch.Tensor, block_ids: torch.Tensor, dst: torch.Tensor) -> bool:
        """Copy pages ``block_ids`` of ``kv`` straight into ``dst`` (``[n, *page]``, contiguous,
        on ``kv``'s device) in one pass, when the block dimension is the first (no temporary);
        False, nothing copied, otherwise (then :meth:`gather` and a copy)."""
        if self.block_dim != 0 or dst.device != kv.device or not dst.is_contiguous():
            return False
        if dst.dtype != kv.dtype or tuple(dst.shape) != (block_ids.numel(), *kv.shape[1:]):
            # (index_select's out= would resize a mismatched dst -- a view into the arena --
            # and write past the slot)
            raise ValueError(f"kvtier: pages of shape {tuple(kv.shape[1:])} {kv.dtype} x "
                             f"{block_ids.numel()} do not fit the slot {tuple(dst.shape)} {dst.dtype}")
        torch.index_select(kv, 0, block_ids, out=dst)
        return True

    def scatter(self, kv: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
        """Write ``pages`` (``[n, *page]``) into blocks ``block_ids`` of ``kv``."""
        kv.index_copy_(self.block_dim, block_ids, pages.movedim(0, self.block_dim).to(kv.device))


def _cpu(blocks: int, bs: int, lay: KVLayout) -> tuple[int, ...]:
    return (blocks, lay.num_kv_heads, bs, 2 * lay.head_dim)


def _kv_first(blocks: int, bs: int, lay: KVLayout) -> tuple[int, ...]:
    return (2, blocks, bs, lay.num_kv_heads, lay.head_dim)


def _blocks_first(blocks: int, bs: int, lay: KVLayout) -> tuple[int, ...]:
    return (blocks, 2, bs, lay.num_kv_heads, lay.head_dim)


def _latent(blocks: int, bs: int, lay: KVLayout) -> tuple[int, ...]:
    return (blocks, bs, lay.head_dim)


ADAPTERS: dict[str, PageAdapter] = {
    "CPU_ATTN": PageAdapter("CPU_ATTN", 0, _cpu),
    "FLASH_ATTN": PageAdapter("FLASH_ATTN", 1, _kv_first),
    "FLASHINFER": PageAdapter("FLASHINFER", 0, _blocks_first),
    "TRITON_ATTN": PageAdapter("TRITON_ATTN", 0, _blocks_first),
}
MLA = PageAdapter("MLA", 0, _latent)


def adapter_for(backend: str) -> PageAdapter:
    """The adapter of a vLLM attention backend, by the name vLLM gives it; ValueError for a
    backend whose page layout kvtier does not know."""
    if backend in ADAPTERS:
        return ADAPTERS[backend]
    if "MLA" in backend.upper():
        return PageAdapter(backend, MLA.block_dim, MLA.shape)
    raise ValueError(f"kvtier has no page adapter for vLLM attention backend {backend!r}; "
                     f"known: {sorted(ADAPTERS)} and the MLA backends")


def page_format(backend: str, dtype: str, block_size: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    """What a vLLM page is, as part of the namespace: pages of other backends, dtypes, block
    sizes and tensor-parallel shards never match."""
    shard = f"-tp{tp_rank}of{tp_size}" if tp_size > 1 else ""
    return f"vllm-{backend.lower()}-{dtype}-bs{block_size}{shard}"
