"""How the transformers engine (:class:`kvtier.engines.hf.HFEngine`) runs a turn."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_new_tokens: int = 32
    layerwise: bool = True
    """Load cached KV layer by layer under the forward pass (else all of it first)."""
    async_save: bool = True
    """Save new KV in the background (else before returning)."""
    device: str = "cpu"
    context_window: int | None = None
    """Tokens the model attends to at most (default: its ``max_position_embeddings``). A chat
    whose prompt plus ``truncation_headroom`` exceeds it loses its oldest turns."""
    truncation_headroom: int | None = None
    """Tokens kept free for the reply when truncating (default: the request's max_new_tokens)."""
    reuse_after_truncation: bool = False
    """After a truncation, re-use the kept turns' cached KV moved to their new positions (keys
    rotated) instead of recomputing it. An approximation: that KV was computed with the dropped
    turns in context. Falls back to recompute (logged) for a model whose RoPE cannot be shifted."""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.context_window is not None and self.context_window <= 0:
            raise ValueError(f"context_window must be positive, got {self.context_window}")
        if self.truncation_headroom is not None and self.truncation_headroom < 0:
            raise ValueError(f"truncation_headroom must be >= 0, got {self.truncation_headroom}")
