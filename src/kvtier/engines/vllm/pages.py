"""vLLM's KV pages: one adapter per attention backend's page layout, and the page format -- the
part of the key namespace that says what a page's bytes are.

vLLM 0.32 to 0.34 hand every backend's KV cache to ``register_kv_caches`` alike, from the GPU
and the CPU model runners: per layer, one logical view ``[blocks, H, N, C]`` of one shared
allocation, in the KV cache's dtype (``vllm/v1/worker/utils.py: allocate_kv_cache`` ->
``vllm/v1/kv_cache_interface.py: create_kv_cache_views``). The physical layout vLLM resolves
(``KVCacheLayout``: ``LBNHC`` unless a backend or ``VLLM_KV_CACHE_LAYOUT`` says otherwise;
``LBHNC`` for CPU_ATTN) sets only the view's strides, never what an index means:

==============  ========  =====  ====================================================
backend         H         N      C (elements)
==============  ========  =====  ====================================================
CPU_ATTN        KV heads  block  ``2*dim``: the block's K, then its V (its kernels view a
                                 head's slot as ``[2*block, dim]``), in the ISA's packing
FLASH_ATTN      KV heads  block  ``2*dim``: each token's K, then its V
FLASHINFER      KV heads  block  ``2*dim``: each token's K, then its V
TRITON_ATTN     KV heads  block  ``2*dim``: each token's K, then its V
``*MLA*``       1         block  ``latent``: one per token (kv_lora_rank + rope dims), no V
==============  ========  =====  ====================================================

Where a backend's kernels take fewer tokens than the scheduler's block (vLLM's
``prepare_kernel_block_sizes``: FlashInfer's 16/32/64 off Blackwell, FlashMLA's 64, CUTLASS
MLA's 128, ...), vLLM splits each block into ``r`` kernel blocks and hands over those:
``[blocks * r, H, block / r, C]``, block ``b`` being rows ``b*r`` to ``b*r + r - 1``.
:meth:`PageAdapter.by_block` views that one row per block, and the page then holds the same
elements in the same order as an unsplit block's: a page does not depend on vLLM's kernel block
size. :meth:`PageAdapter.check` refuses the split tensor as it is (a block id names no row).

kvtier stores one layer of a chunk as its pages in order, each page in the view's logical
element order (``[n, H, N, C]``, whatever the strides): a copy is one gather or scatter along
dim 0 of the tensor vLLM hands over, and a page means something only where it was written. The
adapter is chosen from the backend vLLM's config selects (never guessed from a tensor's sizes);
:meth:`PageAdapter.check` then refuses a tensor that is not in its layout, and the worker stays
off (every load a miss), never copying wrong bytes.

The page format (:func:`engine_page_format`), ``vllm0.32-cpu_attn.amx-bfloat16-bs128-tp1of2``,
holds everything that changes a page's bytes for the same KV, so pages that differ in any of it
never share a chunk (the model and what vLLM computes the KV from are the other part:
:mod:`.namespace`):

- **vLLM's release** (``major.minor``): what a page holds is vLLM's choice and changes with its
  releases. A CPU page's interior is whatever that release's kernels pack (CPU_ATTN's layer was
  ``[2, blocks, heads, block, dim]`` in earlier releases; its ISAs and their packings came and
  changed with them); and 0.32's generic KV layout (RFC #42082) made every backend's layer a
  logical ``[blocks, heads, block, C]`` (FLASH_ATTN's was ``[2, blocks, block, heads, dim]``;
  its C is now each token's K then V). A GPU backend's logical page is no steadier than the
  CPU's, so the release is in every format.
- **The attention backend** vLLM selects (on CPU, MLA models get AMX_MLA or CPU_MLA by the CPU).
- **The kernel that lays the page out, where the machine decides it**: CPU_ATTN's ISA --
  ``amx`` packs both halves of a page, ``vec`` stores K transposed, ``vec16``, ``neon``,
  ``vxe``, ``vsx``, ``rvv`` their own ways -- exactly as vLLM picks it
  (``vllm/v1/attention/backends/cpu_attn.py: _get_attn_isa``, called with what its metadata
  builder passes: the model dtype, the block size, the head size, the KV cache dtype; and this
  CPU's flags). The engine-core process (the scheduler half) and the workers call it on the
  same config and the same CPU, and it reads no state that only workers set, so both halves
  name the same format. (CPU_ATTN takes any block size that is a multiple of 32 as its kernel
  block, so its kernel block is the configured one whenever vLLM starts.)
- **The KV dtype**: the model's, or ``kv<cache dtype>`` (with a digest of
  ``kv_cache_dtype_skip_layers``, the layers kept unquantized). fp8 KV scales come from the
  checkpoint (in the model's fingerprint) or are 1.0; KV scales an engine computes at run time
  (``calculate_kv_scales``, gone from vLLM 0.32) would make every engine's pages its own: refused.
- **The block size**, and **the shard**: tensor- and pipeline-parallel rank and size (the
  scheduler half names rank 0's; each rank stores its own). Decode and prefill context
  parallelism spread a block's tokens over ranks, so a page is no run of tokens: refused.

Deliberately left out: the physical KV layout (``VLLM_KV_CACHE_LAYOUT``, FlashInfer's HND or
NHD: the stride order of the views vLLM hands over -- a gather along the block dimension of a
logical view writes logical order whatever the strides); the GPU and its kernels (they read
one logical layout); vLLM's patch release; the data-parallel rank (each engine of a
data-parallel group holds whole pages of its own).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from kvtier.core.layout import KVLayout


@dataclass(frozen=True)
class PageAdapter:
    """One backend's layer as vLLM hands it over (see the module): ``[blocks, H, N, C]``, a
    block a row, ``H`` and ``C`` set by kvtier's layout. Every copy is one gather or scatter
    along the rows."""

    backend: str
    kv: int
    """2: each token's K and V (an attention layout); 1: one latent per token (MLA)."""
    cell: Callable[[KVLayout], tuple[int, int]]
    """layout -> (H, C): a page's head slots, and the elements of one (slot, token)."""

    def shape(self, num_blocks: int, block_size: int, layout: KVLayout) -> tuple[int, ...]:
        """A layer's shape, as vLLM hands it over where its kernels take whole blocks."""
        heads, content = self.cell(layout)
        return (num_blocks, heads, block_size, content)

    def by_block(self, kv: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
        """``kv`` one row per block of ``block_size`` tokens: ``kv`` itself, or, where vLLM
        split each of its ``num_blocks`` blocks into ``r`` kernel blocks (``[num_blocks * r, H,
        block_size / r, C]``), the view ``[num_blocks, H, r, block_size / r, C]`` of the same
        memory (nothing copied), whose page holds the block's tokens in order."""
        ratio = _kernel_blocks(kv, num_blocks, block_size)
        return kv if ratio == 1 else kv.unflatten(0, (num_blocks, ratio)).transpose(1, 2)

    def check(self, kv: torch.Tensor, num_blocks: int, block_size: int, layout: KVLayout) -> None:
        """Raise ValueError, naming what it saw, unless ``kv`` is a layer of this backend for
        blocks ``0 .. num_blocks - 1`` of ``block_size`` tokens in ``layout``, a block a row:
        ``[rows, H, block_size, C]``, or :meth:`by_block`'s view of kernel blocks. ``rows`` may
        pass ``num_blocks``: vLLM 0.34's extensible KV cache, in a layout that is not
        block-compact, hands over views of its whole capacity, whose blocks past the committed
        ones no block id names."""
        if layout.kv != self.kv:
            holds = {1: "one latent per token", 2: "each token's K and V"}
            raise ValueError(f"{self.backend}: its pages hold {holds[self.kv]}, the layout's "
                             f"{holds[layout.kv]} ({layout})")
        heads, content = self.cell(layout)
        page = tuple(kv.shape[1:])
        split = len(page) == 4 and (page[0], page[1] * page[2], page[3]) == (heads, block_size, content)
        if not (page == (heads, block_size, content) or split) or not 0 < num_blocks <= kv.shape[0]:
            ratio = _kernel_blocks(kv, num_blocks, block_size)
            why = (f"; vLLM splits each {block_size}-token block into {ratio} kernel blocks of "
                   f"{block_size // ratio} tokens, so a block id names no row: view it by_block"
                   if ratio > 1 else "")
            raise ValueError(f"{self.backend}: a layer's KV tensor should be "
                             f"{self.shape(num_blocks, block_size, layout)} ([blocks, H, tokens, C], "
                             f"at least {num_blocks} blocks, for {layout}), got {tuple(kv.shape)}{why}")
        if str(kv.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"{self.backend}: KV tensor dtype {kv.dtype} is not the layout's {layout.dtype}")

    def page_bytes(self, kv: torch.Tensor) -> int:
        return kv[0].numel() * kv.element_size()

    def pages(self, chunk_layer: torch.Tensor, kv: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` pages stored in ``chunk_layer`` (a uint8 view of one layer of one chunk), as
        ``[count, *page]`` in ``kv``'s dtype."""
        n = count * self.page_bytes(kv)
        return chunk_layer[:n].view(kv.dtype).view(count, *kv.shape[1:])

    def gather(self, kv: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Pages ``block_ids`` of ``kv`` as ``[n, *page]`` (a new, contiguous tensor)."""
        return kv.index_select(0, block_ids)

    def gather_into(self, kv: torch.Tensor, block_ids: torch.Tensor, dst: torch.Tensor) -> bool:
        """Copy pages ``block_ids`` of ``kv`` straight into ``dst`` (``[n, *page]``, contiguous,
        on ``kv``'s device) in one pass (no temporary); False, nothing copied, where ``dst`` is
        not such a tensor (then :meth:`gather` and a copy)."""
        if dst.device != kv.device or not dst.is_contiguous():
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
        kv.index_copy_(0, block_ids, pages.to(kv.device))


def _kernel_blocks(kv: torch.Tensor, num_blocks: int, block_size: int) -> int:
    """``r`` where ``kv`` is vLLM's view of ``num_blocks`` blocks of ``block_size`` tokens split
    into ``r`` kernel blocks each (exactly ``num_blocks * r`` rows of ``block_size / r``); else 1."""
    if kv.dim() != 4 or num_blocks < 1 or not 0 < kv.shape[2] < block_size or block_size % kv.shape[2]:
        return 1
    ratio = block_size // kv.shape[2]
    return ratio if kv.shape[0] == num_blocks * ratio else 1


def _attention(lay: KVLayout) -> tuple[int, int]:
    return (lay.num_kv_heads, 2 * lay.head_dim)


def _latent(lay: KVLayout) -> tuple[int, int]:
    return (1, lay.head_dim)


ADAPTERS: dict[str, PageAdapter] = {
    name: PageAdapter(name, 2, _attention) for name in ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
}
MLA = PageAdapter("MLA", 1, _latent)


def adapter_for(backend: str) -> PageAdapter:
    """The adapter of a vLLM attention backend, by the name vLLM gives it; ValueError for a
    backend whose page layout kvtier does not know."""
    if backend in ADAPTERS:
        return ADAPTERS[backend]
    if "MLA" in backend.upper():
        return PageAdapter(backend, MLA.kv, MLA.cell)
    raise ValueError(f"kvtier has no page adapter for vLLM attention backend {backend!r}; "
                     f"known: {sorted(ADAPTERS)} and the MLA backends")


def engine_page_format(vllm_config, backend: str, tp_rank: int = 0, pp_rank: int = 0) -> str:  # type: ignore[no-untyped-def]
    """The page format of the engine ``vllm_config`` describes, as rank (``tp_rank``,
    ``pp_rank``) holds its pages under ``backend`` (the name vLLM gives the attention backend it
    selects): the scheduler half names rank 0's, each worker its own. Made of vLLM's config and
    of decisions vLLM makes on this machine the same way in every process (see the module);
    ValueError, naming why, for an engine whose pages no format can name."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    _refuse_unnameable(cc, pc)
    cache_dtype = str(getattr(cc, "cache_dtype", "auto") or "auto")
    dtype = str(mc.dtype).removeprefix("torch.") if cache_dtype == "auto" else f"kv{cache_dtype}"
    skipped = sorted(str(s) for s in getattr(cc, "kv_cache_dtype_skip_layers", None) or ())
    if cache_dtype != "auto" and skipped:  # these layers keep the model's dtype
        dtype += f".skip{xxhash.xxh3_64_hexdigest(','.join(skipped).encode())}"
    return page_format(backend, dtype, int(cc.block_size), vllm=vllm_release(),
                       kernel=attention_kernel(vllm_config, backend),
                       tp=(tp_rank, int(getattr(pc, "tensor_parallel_size", 1) or 1)),
                       pp=(pp_rank, int(getattr(pc, "pipeline_parallel_size", 1) or 1)))


def page_format(backend: str, dtype: str, block_size: int, *, vllm: str, kernel: str = "",
                tp: tuple[int, int] = (0, 1), pp: tuple[int, int] = (0, 1)) -> str:
    """``vllm<release>-<backend>[.<kernel>]-<dtype>-bs<block>[-tp<rank>of<size>][-pp<rank>of<size>]``:
    pages that differ in any part never match. (The daemon's HTTP lookup reads ``-bs<block>``
    and tells rank 0 from the others by ``-tp``/``-pp``: keep those.)"""
    shard = "".join(f"-{name}{rank}of{size}" for name, (rank, size) in (("tp", tp), ("pp", pp)) if size > 1)
    kind = backend.lower() + (f".{kernel}" if kernel else "")
    return f"vllm{vllm}-{kind}-{dtype}-bs{block_size}{shard}"


def vllm_release() -> str:
    """vLLM's ``major.minor``: the releases' page layouts differ (see the module)."""
    import vllm

    version = str(vllm.__version__)
    found = re.match(r"(\d+)\.(\d+)", version)
    return f"{found[1]}.{found[2]}" if found else version


def attention_kernel(vllm_config, backend: str) -> str:  # type: ignore[no-untyped-def]
    """The kernel vLLM lays ``backend``'s pages out for, where that depends on the machine:
    CPU_ATTN's ISA, by vLLM's own choice (``cpu_attn._get_attn_isa``, from the model dtype,
    block size, head size and KV cache dtype and this CPU's flags, as its attention metadata
    builder and ``CpuPlatform.pack_kv_cache`` call it); "" for the others, whose pages vLLM
    hands over in one logical layout whatever kernel reads them."""
    if backend != "CPU_ATTN":
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:
        raise ValueError(f"kvtier cannot ask vLLM {vllm_release()} which ISA its CPU attention lays pages "
                         f"out for ({exc}): use a vLLM release kvtier supports") from None
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    given = {"dtype": mc.dtype, "block_size": int(cc.block_size), "head_size": mc.get_head_size(),
             "kv_cache_dtype": cc.cache_dtype}
    takes = inspect.signature(_get_attn_isa).parameters  # (its arguments grew with vLLM's releases)
    try:
        return str(_get_attn_isa(**{name: value for name, value in given.items() if name in takes}))
    except TypeError as exc:
        raise ValueError(f"kvtier cannot ask vLLM {vllm_release()} which ISA its CPU attention lays pages "
                         f"out for ({exc}): use a vLLM release kvtier supports") from None
    except NotImplementedError as exc:  # vLLM's own refusal, met here before its workers meet it
        raise ValueError(f"vLLM's CPU attention cannot run this engine: {exc}") from None


def _refuse_unnameable(cache_config, parallel_config) -> None:  # type: ignore[no-untyped-def]
    """ValueError for an engine whose pages differ where no format can say how: KV scales each
    engine computes at run time, or a block's tokens spread over context-parallel ranks."""
    if getattr(cache_config, "calculate_kv_scales", False) and str(cache_config.cache_dtype) != "auto":
        raise ValueError("kvtier: calculate_kv_scales makes each engine quantize its KV with scales of its "
                         "own, so two engines' pages never mean the same; load fp8 KV scales from the "
                         "checkpoint (they are in the model's fingerprint) or run without kvtier")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(parallel_config, name, 1) or 1)
        if size > 1:
            raise ValueError(f"kvtier: {name}={size} spreads each block's tokens over {size} ranks "
                             "(interleaved), so a rank's page is not a run of the block's tokens, which "
                             "kvtier's chunks are made of; run without context parallelism or without kvtier")
