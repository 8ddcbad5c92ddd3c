"""What the KV codecs (:mod:`kvtier.tiers.codecs`) are named and read: the codec names and ids,
the KV dtypes, :class:`KVFormat` (what the raw bytes of a segment are) and :class:`CodecError`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.core.layout import DTYPE_BYTES
from kvtier.errors import KVTierError

CODECS = ("none", "fp8", "int8", "int4")
"""Codec names a tier accepts (``"auto"`` is resolved to one of these when a store starts)."""
CODEC_IDS = {"fp8": 1, "int8": 2, "int4": 3}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
DTYPES = {"float32": (1, torch.float32), "float16": (2, torch.float16), "bfloat16": (3, torch.bfloat16)}
DTYPE_NAMES = {code: name for name, (code, _) in DTYPES.items()}


class CodecError(KVTierError, ValueError):
    """A segment cannot be framed with this codec, or bytes are not a valid frame."""


@dataclass(frozen=True, slots=True)
class KVFormat:
    """What the raw bytes of a segment are: their dtype, the row width, K-and-V or a latent."""

    dtype: str
    head_dim: int
    kv: int = 2

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"a KV codec reads {sorted(DTYPES)} KV, not {self.dtype!r}")
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"KVFormat.head_dim must be a positive int, got {self.head_dim!r}")
        if self.kv not in (1, 2):
            raise ValueError(f"KVFormat.kv must be 1 or 2, got {self.kv!r}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @classmethod
    def of_layout(cls, layout: object) -> KVFormat | None:
        """The format of a :class:`~kvtier.core.layout.KVLayout`'s segments, or None when its
        dtype is one no codec reads (fp8 KV is already compressed)."""
        dtype = getattr(layout, "dtype", None)
        if dtype not in DTYPES:
            return None
        return cls(dtype, int(layout.head_dim), int(layout.kv))  # type: ignore[attr-defined]


def check_codec(name: object, where: str) -> str:
    if name not in CODECS:
        raise ValueError(f"{where}: codec must be one of {list(CODECS)}, got {name!r}")
    return name  # type: ignore[return-value]
