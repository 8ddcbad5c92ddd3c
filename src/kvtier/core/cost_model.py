"""What a prefill costs: the compute model shared by the ``cost`` policy and trace replay.

A miss on a chunk means recomputing it: every weight is multiplied by every new token (``2 x
params`` FLOPs a token) and every new token attends to the whole history before it (``4 x
layers x hidden x position`` FLOPs a token for ``QK^T`` and ``AV``), so a chunk deep in a long
conversation costs more than the first one. A hit costs the time to read the chunk from its tier.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeModel:
    """A dense decoder and the sustained FLOP rate of one serving instance.

    The defaults are a Llama-3-8B-like model on one accelerator sustaining 400 TFLOP/s.
    """

    num_layers: int = 32
    hidden: int = 4096
    """Width of the attention (query heads x head dim)."""
    params: float = 8.0e9
    """Weights multiplied per token (non-embedding parameters)."""
    flops: float = 400e12
    """Sustained FLOP/s of one instance during prefill."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ComputeModel.{name} must be a positive int, got {value!r}")
        for name in ("params", "flops"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ComputeModel.{name} must be a positive number, got {value!r}")

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to prefill tokens ``[start, end)`` when the first ``start`` are cached."""
        if not 0 <= start <= end:
            raise ValueError(f"need 0 <= start <= end, got {start}, {end}")
        linear = 2.0 * self.params * (end - start)
        # sum over t in [start, end) of 4 * layers * hidden * t, in closed form.
        attention = 2.0 * self.num_layers * self.hidden * (end * end - start * start)
        return linear + attention

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to prefill tokens ``[start, end)`` after a cached prefix of ``start`` tokens."""
        return self.prefill_flops(start, end) / self.flops

    def chunk_recompute_s(self, position: int, chunk_tokens: int) -> float:
        """Seconds to recompute chunk number ``position`` (0 is the first) of a sequence."""
        return self.prefill_s(position * chunk_tokens, (position + 1) * chunk_tokens)
