"""Moving KV bytes between an engine's tensors and a chunk's layer-major bytes.

Bookkeeping (which chunk, which tier) lives in the store; this module only copies. The engine's
KV for one layer is ``(K, V)``, each ``[num_kv_heads, tokens, head_dim]`` (a leading batch
dimension of 1 is accepted), on any device; chunk bytes are a flat ``uint8`` tensor on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.core.layout import KVLayout

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

LayerKV = tuple[torch.Tensor, ...]
"""One layer's KV: ``(K, V)`` (or ``(latent,)`` when ``layout.kv == 1``)."""


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return TORCH_DTYPES[layout.dtype]


def check_kv(kv: Sequence[Sequence[torch.Tensor]], layout: KVLayout) -> tuple[list[LayerKV], int]:
    """Validate an engine's KV against ``layout``; return 3-D views and the token count.

    Raises ValueError or TypeError naming the layer and the problem.
    """
    if isinstance(kv, torch.Tensor) or not isinstance(kv, Sequence):
        raise TypeError("kv must be a sequence with one (K, V) pair per layer")
    if len(kv) != layout.num_layers:
        raise ValueError(f"kv has {len(kv)} layers, layout has {layout.num_layers}")
    dtype = torch_dtype(layout)
    layers: list[LayerKV] = []
    tokens = -1
    for idx, pair in enumerate(kv):
        if isinstance(pair, torch.Tensor) or len(pair) != layout.kv:
            raise ValueError(f"kv layer {idx} must hold {layout.kv} tensors (K and V)")
        views = []
        for t in pair:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv layer {idx} holds a {type(t).__name__}, not a tensor")
            if t.dim() == 4 and t.shape[0] == 1:
                t = t[0]
            if t.dim() != 3 or t.shape[0] != layout.num_kv_heads or t.shape[2] != layout.head_dim:
                raise ValueError(
                    f"kv layer {idx} has shape {tuple(t.shape)}; expected "
                    f"[{layout.num_kv_heads}, tokens, {layout.head_dim}] (batch of 1 allowed)"
                )
            if t.dtype != dtype:
                raise TypeError(f"kv layer {idx} has dtype {t.dtype}; layout says {dtype}")
            if tokens not in (-1, t.shape[1]):
                raise ValueError(f"kv layer {idx} has {t.shape[1]} tokens, earlier layers {tokens}")
            tokens = t.shape[1]
            views.append(t)
        layers.append(tuple(views))
    return layers, tokens


def chunk_view(raw: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A chunk's bytes as ``[num_layers, kv, heads, chunk_tokens, head_dim]`` (zero-copy)."""
    return raw.view(torch_dtype(layout)).view(
        layout.num_layers, layout.kv, layout.num_kv_heads, layout.chunk_tokens, layout.head_dim
    )


def layer_view(raw: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """One layer's bytes of one chunk as ``[kv, heads, chunk_tokens, head_dim]``."""
    return raw.view(torch_dtype(layout)).view(
        layout.kv, layout.num_kv_heads, layout.chunk_tokens, layout.head_dim
    )


def pack_chunk(dst: torch.Tensor, kv: Sequence[LayerKV], chunk: int, layout: KVLayout) -> None:
    """Copy chunk ``chunk`` of ``kv`` (tokens ``[chunk*C, (chunk+1)*C)``) into ``dst`` bytes."""
    c = layout.chunk_tokens
    view = chunk_view(dst, layout)
    for layer, pair in enumerate(kv):
        for j, t in enumerate(pair):
            view[layer, j].copy_(t[:, chunk * c : (chunk + 1) * c, :])


def unpack_layer(src: torch.Tensor, out: LayerKV, chunk: int, layout: KVLayout) -> None:
    """Copy one layer of one chunk (``src``: that layer's bytes) into ``out`` at its position."""
    c = layout.chunk_tokens
    view = layer_view(src, layout)
    for j, t in enumerate(out):
        t[:, chunk * c : (chunk + 1) * c, :].copy_(view[j])
