"""Attention for a prefill that continues a cached prefix, registered with transformers as
``kvtier_sdpa``.

A prefill of ``L`` new tokens after ``P`` cached ones has a causal mask aligned to the bottom
right. Stock SDPA gets it as an explicit mask, and on CPU that makes it compute every query
against every key and mask afterwards: a prefill after a short cached prefix was slower than a
recompute of the whole prompt. Here the attention is split at the prefix: the new queries attend
to the prefix keys without a mask and to their own keys with ``is_causal`` (both fast kernels),
and the two halves are merged with their log-sum-exp, which is exact.

Used only for batch-1, unpadded requests on CPU (what the kvtier engine runs); everything else
goes to transformers' own SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

NAME = "kvtier_sdpa"


def prefix_sdpa_forward(  # type: ignore[no-untyped-def]
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    q_len, kv_len = query.shape[2], key.shape[2]
    prefix = kv_len - q_len
    plain = (
        query.device.type != "cpu"
        or query.shape[0] != 1
        or q_len <= 1
        or prefix <= 0
        or dropout
        or kwargs.get("position_bias") is not None
        or getattr(module, "sliding_window", None)
        or key.shape[-1] != value.shape[-1]
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_p, lse_p = flash(query, key[:, :, :prefix], value[:, :, :prefix], 0.0, False, scale=scaling)
    out_n, lse_n = flash(query, key[:, :, prefix:], value[:, :, prefix:], 0.0, True, scale=scaling)
    lse = torch.logaddexp(lse_p, lse_n)
    out = out_p * torch.exp(lse_p - lse).unsqueeze(-1) + out_n * torch.exp(lse_n - lse).unsqueeze(-1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, prefix_sdpa_forward)
