"""The KV layout of a transformers model, as its config implies it."""

from __future__ import annotations

from transformers import PretrainedConfig

from kvtier.core.layout import KVLayout


def kv_layout_for(config: PretrainedConfig, chunk_tokens: int = 256, dtype: str = "float32") -> KVLayout:
    """The KV layout of a rotary decoder-only model (Llama, Qwen2, Mistral families)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return KVLayout(
        num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
        dtype=dtype, chunk_tokens=chunk_tokens,
    )
