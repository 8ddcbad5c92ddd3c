"""The shape of the KV cache kvtier stores, and the byte layout of one chunk.

A chunk is stored **layer-major**: for each layer ``l`` in order, one contiguous block holding
K then V (``kv`` tensors), each ``[num_kv_heads, chunk_tokens, head_dim]`` in ``dtype``. So one
layer of one chunk is one contiguous byte range and can be read alone, which layer-wise
pre-loading depends on.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True)
class KVLayout:
    """Geometry of the KV cache of one model, and the byte sizes it implies."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    chunk_tokens: int = 256
    kv: int = 2
    """2 for separate K and V; 1 for a single latent (MLA-style) tensor."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.kv not in (1, 2):
            raise ValueError(f"KVLayout.kv must be 1 or 2, got {self.kv}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"KVLayout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tensor_shape(self) -> tuple[int, int, int]:
        """Shape of one of K or V of one layer of one chunk."""
        return (self.num_kv_heads, self.chunk_tokens, self.head_dim)

    @property
    def tensor_bytes(self) -> int:
        return self.num_kv_heads * self.chunk_tokens * self.head_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one chunk (K and V)."""
        return self.kv * self.tensor_bytes

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk, all layers."""
        return self.num_layers * self.layer_bytes

    def layer_offset(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        return layer * self.layer_bytes

    def part_layer_bytes(self, tokens: int) -> int:
        """Bytes of one layer of a partial chunk of ``tokens`` tokens (1..``chunk_tokens``):
        a partial chunk is stored as its own tokens of every layer, layer-major like a full
        one, so it costs its own size wherever it is kept."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 < tokens <= self.chunk_tokens:
            raise ValueError(f"a partial chunk holds 1 to {self.chunk_tokens} tokens, got {tokens!r}")
        return self.layer_bytes // self.chunk_tokens * tokens

    def part_bytes(self, tokens: int) -> int:
        """Bytes of a partial chunk of ``tokens`` tokens, all layers (see :meth:`part_layer_bytes`)."""
        return self.num_layers * self.part_layer_bytes(tokens)

    def bytes_for_tokens(self, tokens: int) -> int:
        """KV bytes of ``tokens`` tokens (all layers), for capacity planning."""
        return tokens * self.chunk_bytes // self.chunk_tokens

    @property
    def fingerprint(self) -> str:
        """Stable id of this layout; part of every chunk key's namespace."""
        desc = (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{self.dtype}"
            f"-C{self.chunk_tokens}-kv{self.kv}-layer_major"
        )
        return xxhash.xxh3_64_hexdigest(desc.encode())
