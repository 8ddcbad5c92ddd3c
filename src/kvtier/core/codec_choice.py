"""``codec = "auto"``: the codec whose load is fastest within a quality budget.

Loading a chunk from a tier through a codec takes ``ratio / read_Bps + 1 / decode_Bps`` seconds
per raw byte (the stored bytes read at the tier's bandwidth, then decoded); raw, ``1 / read_Bps``.
Among the codecs whose measured quality loss (mean KL divergence of the next-token distribution,
exact KV against the codec's, in nats) is within the user's budget, ``auto`` takes the one with
the lowest load time. ``"none"`` loses nothing and is always a candidate, so a fast tier or a
zero budget keeps chunks exact.

The figures come from the machine: the tier's read bandwidth and each codec's decode rate are
measured when the tier starts (:func:`kvtier.tiers.codecs.measure`); the quality of each codec is
what ``kvtier bench codecs`` measured on SmolLM2-135M-Instruct over ShareGPT histories of
1K-8K tokens (:data:`MEASURED_KL`), which a user may replace with their own model's figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MEASURED_KL: dict[str, float] = {"none": 0.0, "fp8": 0.0041, "int8": 0.0003, "int4": 0.045}
"""Mean KL (nats) per codec measured by ``kvtier bench codecs --score-tokens 256`` on
SmolLM2-135M-Instruct (the worst of histories of 1K, 2K, 4K and 8K tokens; see the README's codec
table)."""
DEFAULT_MAX_KL = 0.005
"""The default quality budget: int8's loss fits it, int4's does not."""


@dataclass(frozen=True, slots=True)
class CodecFigures:
    """One codec's figures on this machine."""

    codec: str
    ratio: float
    """Stored bytes over raw bytes (1.0 for ``none``)."""
    decode_Bps: float
    """Raw bytes decoded per second (inf for ``none``)."""
    kl: float
    """Quality loss, mean KL in nats (0 for ``none``)."""

    def load_s_per_byte(self, read_Bps: float) -> float:
        decode = 0.0 if math.isinf(self.decode_Bps) else 1.0 / self.decode_Bps
        return self.ratio / read_Bps + decode


def choose_codec(figures: list[CodecFigures], read_Bps: float, max_kl: float) -> str:
    """The codec of ``figures`` with the fastest load within ``max_kl`` (``none`` when no other
    fits, or none is faster). ValueError for a bandwidth or budget that is not a positive
    number (a zero budget is allowed: exact only)."""
    if not (isinstance(read_Bps, (int, float)) and read_Bps > 0):
        raise ValueError(f"codec auto: the tier's read bandwidth must be positive, got {read_Bps!r}")
    if not (isinstance(max_kl, (int, float)) and max_kl >= 0):
        raise ValueError(f"codec auto: max_kl must be a number >= 0, got {max_kl!r}")
    best, best_s = "none", 1.0 / read_Bps
    for f in figures:
        if f.codec == "none" or f.kl > max_kl:
            continue
        s = f.load_s_per_byte(read_Bps)
        if s < best_s:
            best, best_s = f.codec, s
    return best


def figures_from(ratios: Mapping[str, float], decode_Bps: Mapping[str, float],
                 kl: Mapping[str, float] | None = None) -> list[CodecFigures]:
    """Figures for the codecs of ``ratios`` (those without a quality figure are left out)."""
    kl = MEASURED_KL if kl is None else kl
    return [CodecFigures(c, ratios[c], decode_Bps[c], kl[c]) for c in ratios if c in kl and c in decode_Bps]
