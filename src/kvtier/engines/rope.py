"""Moving cached keys to another position: rotary position embeddings (RoPE) shifted by a delta.

With RoPE, the key of a token at position ``p`` is ``R(p) k`` (``R`` rotates each pair of
dimensions ``(i, i + r/2)`` of the rotary part by ``p * inv_freq[i]``), so the key the same token
would have at ``p + d`` is ``R(d) R(p) k``: cached keys can be moved by rotating them, without the
projection they came from. Values carry no position. This is exact (up to float rounding) for
every RoPE whose frequencies do not depend on the position or the sequence length:

- ``default``, ``linear``, ``llama3``, ``yarn``: the frequencies are fixed at load time and read
  from the model's own rotary embedding module (``inv_freq``), so their scaling is covered as is.
  YaRN also multiplies cos and sin by ``attention_scaling``; a cached key already carries that
  factor once, and the rotation by ``d`` is a pure rotation that must not apply it again.
- partial rotary (``partial_rotary_factor < 1``, Phi-3): only the first ``2 * len(inv_freq)``
  dimensions rotate; the rest are left as they are.

Refused, with the reason (:func:`shift_refusal`): ``dynamic`` NTK and ``longrope`` (their
frequencies change with the sequence length, so a key computed in a shorter or longer context is
not a rotation of the one wanted), several rotary modules (per-layer RoPE, Gemma-3), model
families whose rotation pairs dimensions differently (GPT-J and GLM interleave them) or that are
not known to kvtier, and models without RoPE.

Device-agnostic and dtype-preserving: the angles are computed on the CPU in float64 (a shift is
one delta for all tokens, so that is a vector of ``r/2`` numbers), the rotation in float32 on the
keys' device, and the result is cast back to the keys' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

SHIFTABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose frequencies are fixed: a shift is a rotation."""

HALF_ROTATION_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
})
"""Model families whose attention applies ``x * cos + rotate_half(x) * sin`` to the first rotary
dimensions of every key (the layout :func:`shift_keys` undoes). Others are refused until checked:
a family that pairs dimensions differently would get wrong keys, not an error."""

_NOT_A_ROTATION = {
    "dynamic": "its frequencies grow with the sequence length (dynamic NTK scaling)",
    "longrope": "it switches frequency sets past original_max_position_embeddings",
}


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def rope_type_of(config: PretrainedConfig) -> str | None:
    """The RoPE variant of a model config (``default`` when RoPE is plain), or None without a
    single model-wide RoPE."""
    text = _text_config(config)
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if params is None:
        return "default" if getattr(text, "rope_theta", None) is not None else None
    if not isinstance(params, dict):
        return None
    kind = params.get("rope_type", params.get("type"))
    if kind is None and any(isinstance(v, dict) for v in params.values()):
        return None  # one RoPE per layer type
    return str(kind or "default")


def shift_refusal(config: PretrainedConfig) -> str | None:
    """Why this model's cached keys cannot be moved by rotation, or None if they can."""
    text = _text_config(config)
    model_type = getattr(text, "model_type", "?")
    if model_type not in HALF_ROTATION_MODEL_TYPES:
        return (f"model type {model_type!r} is not one whose RoPE layout kvtier knows "
                f"({', '.join(sorted(HALF_ROTATION_MODEL_TYPES))})")
    kind = rope_type_of(text)
    if kind is None:
        return f"model type {model_type!r} has no single model-wide rotary position embedding"
    if kind not in SHIFTABLE_ROPE_TYPES:
        why = _NOT_A_ROTATION.get(kind, "kvtier does not know whether a shift is a rotation for it")
        return f"rope_type {kind!r} cannot be shifted: {why}"
    return None


@dataclass(frozen=True)
class RotaryShift:
    """The rotation that moves cached keys of one model by a number of positions."""

    inv_freq: torch.Tensor
    """Float64 on the CPU, ``[rotary_dim / 2]``: the model's own frequencies."""
    head_dim: int

    def __post_init__(self) -> None:
        if self.inv_freq.ndim != 1 or self.inv_freq.numel() == 0:
            raise ValueError(f"inv_freq must be a non-empty vector, got shape {tuple(self.inv_freq.shape)}")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} exceeds the head dim {self.head_dim}")

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> RotaryShift:
        """The shift for ``model``, from its rotary embedding module. Raises ValueError (with
        :func:`shift_refusal`'s reason) for a model whose keys cannot be shifted."""
        config = model.config
        reason = shift_refusal(config)
        if reason is not None:
            raise ValueError(reason)
        rotary = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
        if len(rotary) != 1:
            raise ValueError(f"expected one rotary embedding module, found {len(rotary)}")
        text = _text_config(config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(rotary[0].inv_freq.detach().to("cpu", torch.float64), head_dim)

    def shift_keys(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` (``[..., tokens, head_dim]``, post-RoPE, any device and dtype) as they would
        be ``delta`` positions later (earlier if negative). A new tensor of the same dtype."""
        if keys.shape[-1] != self.head_dim:
            raise ValueError(f"keys have head dim {keys.shape[-1]}, the model {self.head_dim}")
        if delta == 0:
            return keys.clone()
        r = self.rotary_dim
        angle = float(delta) * self.inv_freq  # float64: exact enough for any context length
        angle = torch.cat((angle, angle))
        cos = angle.cos().to(keys.device, torch.float32)
        sin = angle.sin().to(keys.device, torch.float32)
        rot = keys[..., :r].float()
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)  # rotate_half
        out = rot * cos + rotated * sin
        if r < self.head_dim:
            out = torch.cat((out, keys[..., r:].float()), dim=-1)
        return out.to(keys.dtype)
