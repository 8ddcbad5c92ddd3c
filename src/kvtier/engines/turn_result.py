"""What one chat turn through an engine gave: its tokens and text, and where its prompt's KV
came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TurnResult:
    prompt_tokens: int
    hit_tokens: int
    """Prompt tokens whose KV came from kvtier (not computed)."""
    tier: str
    """The slowest tier the hit touched (``host``, ``disk``), or ``-`` for no hit."""
    tier_tokens: dict[str, int]
    """Hit tokens per tier they were read from."""
    ttft_s: float
    """From the request to the first generated token."""
    token_ids: list[int]
    text: str
    first_logits: torch.Tensor
    """Logits of the first generated token (vocab,), for checking against a recompute."""
    load_s: float = 0.0
    """Time spent reading cached KV (in the loader, overlapped with compute when layer-wise)."""
    load_hidden: float = 1.0
    """Share of ``load_s`` that compute hid."""
    retries: int = 0
    """Prefills redone because cached KV turned out unreadable."""
    dropped_turns: int = 0
    """Oldest turns left out to fit the context window."""
    dropped_tokens: int = 0
    """Prompt tokens those turns took."""
    shifted_tokens: int = 0
    """Hit tokens whose KV was cached at later positions and moved (approximate, see
    ``EngineConfig.reuse_after_truncation``); included in ``hit_tokens``."""
    step_logits: torch.Tensor | None = None
    """With ``forced_tokens``: the logits before each of them, ``[tokens, vocab]``."""
