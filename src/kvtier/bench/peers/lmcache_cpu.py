"""LMCache's vLLM connector on vLLM's CPU backend.

LMCache 0.5.6 ships no CPU paged-KV copier for vLLM's CPU backend: when its vLLM worker builds
its engine it picks a "GPU connector" (the piece that copies KV between vLLM's paged cache and
LMCache's memory objects) by device type, and on ``cpu`` it raises ``No supported cpu connector
found``. This module supplies that missing piece and nothing else:

- :class:`CPUPagedKVCopier` copies between vLLM's CPU KV cache tensors and LMCache memory
  objects (format ``KV_2LTD``: ``[2, num_layers, num_tokens, hidden]``) with plain torch indexing.
- :class:`LMCacheCPUConnector` is vLLM's own ``LMCacheConnectorV1`` (which drives LMCache's
  vLLM v1 adapter), made to hand LMCache that copier when it asks for one on ``cpu``.

It only moves bytes: what LMCache stores, looks up, evicts and retrieves (its policy) is
untouched. Standalone on purpose: it imports only the standard library, torch, vLLM and LMCache,
and vLLM loads it as the top-level module ``lmcache_cpu`` (``kv_connector_module_path``).
"""

from __future__ import annotations

import lmcache.v1.gpu_connector as lmcache_gpu_connector
import torch
from lmcache import torch_device_type
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

# vLLM CPU attention kernels whose KV pages this copier knows (see CPUPagedKVCopier).
# "amx" (bfloat16 on AMX machines) packs keys in VNNI pairs; "neon" etc. are untested.
KNOWN_ISAS = ("vec", "vec16")


class CPUPagedKVCopier(GPUConnectorInterface):
    """Copies KV between vLLM's CPU paged cache and LMCache ``KV_2LTD`` memory objects.

    vLLM's CPU attention backend (kernels ``vec``/``vec16``) keeps one contiguous tensor per
    layer, of shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; each
    ``(block, head)`` page holds the keys as ``[head_size, block_size]`` (transposed) followed
    by the values as ``[block_size, head_size]``. A token in cache slot ``s`` lies in block
    ``s // block_size`` at offset ``s % block_size``.

    As with LMCache's CUDA copier, calls get ``kvcaches`` (one tensor per layer, in layer
    order) and the whole sequence's ``slot_mapping`` as keyword arguments, and ``start:end``
    indexes that sequence.

    ``loaded_bytes`` / ``saved_bytes`` count what all copiers of the process moved into and out
    of vLLM's cache (for profiles).
    """

    loaded_bytes = 0
    saved_bytes = 0

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size

    @classmethod
    def from_metadata(cls, metadata: LMCacheMetadata) -> CPUPagedKVCopier:
        """A copier for the model that LMCache's engine ``metadata`` describes."""
        if metadata.use_mla:
            raise NotImplementedError("MLA KV caches are not supported on CPU")
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers, num_kv_heads, head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def _pages(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer: keys ``[blocks, heads, head_size, block_size]`` and values
        ``[blocks, heads, block_size, head_size]``."""
        num_blocks, heads, block_size, _ = layer.shape
        pages = layer.view(num_blocks, heads, 2, block_size * self.head_size)
        return (pages[:, :, 0].view(num_blocks, heads, self.head_size, block_size),
                pages[:, :, 1].view(num_blocks, heads, block_size, self.head_size))

    @staticmethod
    def _slots(kwargs: dict, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in block) of each token in ``start:end``."""
        block_size = kwargs["kvcaches"][0].shape[2]
        slots = kwargs["slot_mapping"][start:end].to(torch.long)
        return slots // block_size, slots % block_size

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        """Copy tokens ``start:end`` of every layer from vLLM's cache into ``memory_obj``."""
        blocks, offsets = self._slots(kwargs, start, end)
        out = memory_obj.tensor
        for i, layer in enumerate(kwargs["kvcaches"]):
            keys, values = self._pages(layer)  # each gathered as [tokens, heads, head_size]
            out[0, i].copy_(keys[blocks, :, :, offsets].flatten(1))
            out[1, i].copy_(values[blocks, :, offsets].flatten(1))
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD
        CPUPagedKVCopier.saved_bytes += out.nbytes

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        """Copy ``memory_obj`` (tokens ``start:end``) into vLLM's cache at their slots.

        Tokens below ``vllm_cached_tokens`` are in vLLM's cache already and are left alone,
        as LMCache's CUDA copier leaves them.
        """
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"expected a KV_2LTD memory object, got {memory_obj.metadata.fmt}")
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        blocks, offsets = self._slots(kwargs, start + skip, end)
        src = memory_obj.tensor[:, :, skip:].unflatten(-1, (self.num_kv_heads, self.head_size))
        for i, layer in enumerate(kwargs["kvcaches"]):
            keys, values = self._pages(layer)
            keys[blocks, :, :, offsets] = src[0, i]
            values[blocks, :, offsets] = src[1, i]
        CPUPagedKVCopier.loaded_bytes += src.nbytes

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


_lmcache_create_gpu_connector = lmcache_gpu_connector.CreateGPUConnector


def _create_gpu_connector(config, metadata, engine, layout_hints=None):
    """LMCache's ``CreateGPUConnector``, answering :class:`CPUPagedKVCopier` for vLLM on ``cpu``
    (where LMCache's raises) and deferring to LMCache's everywhere else."""
    if engine == EngineType.VLLM and torch_device_type == "cpu":
        if config.use_layerwise or config.enable_blending:
            raise NotImplementedError("the CPU copier supports neither layerwise nor blending")
        return CPUPagedKVCopier.from_metadata(metadata)
    return _lmcache_create_gpu_connector(config, metadata, engine, layout_hints=layout_hints)


class LMCacheCPUConnector(LMCacheConnectorV1):
    """vLLM's ``LMCacheConnectorV1`` with :class:`CPUPagedKVCopier` as LMCache's copier on CPU.

    LMCache's worker looks ``CreateGPUConnector`` up in ``lmcache.v1.gpu_connector`` when it
    builds its engine (inside the parent's ``__init__``), so that name is pointed at the
    CPU-aware factory first. Refuses, at start, a CPU attention kernel whose page layout the
    copier does not know. Everything else is the parent's.
    """

    def __init__(self, vllm_config, role, kv_cache_config):
        model, cache = vllm_config.model_config, vllm_config.cache_config
        isa = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(),
                            cache.cache_dtype)
        if torch_device_type == "cpu" and isa not in KNOWN_ISAS:
            raise NotImplementedError(
                f"vLLM's CPU attention kernel {isa!r} lays KV pages out in a way "
                f"{type(self).__name__} does not know (known: {', '.join(KNOWN_ISAS)})")
        lmcache_gpu_connector.CreateGPUConnector = _create_gpu_connector
        super().__init__(vllm_config, role, kv_cache_config)
        self._worker = role.name == "WORKER"

    def profile_counters(self) -> dict[str, float]:
        """Bytes copied into and out of vLLM's cache so far (the worker's; LMCache runs no
        daemon here: its tiers are in this process)."""
        if not self._worker:
            return {}
        return {"loaded_bytes": CPUPagedKVCopier.loaded_bytes, "saved_bytes": CPUPagedKVCopier.saved_bytes}
