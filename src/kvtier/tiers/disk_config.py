"""The SSD tier's configuration (:class:`DiskTierConfig`), checked when it is made."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtier.core.codec_choice import DEFAULT_MAX_KL
from kvtier.tiers.codec_types import CODECS


@dataclass(frozen=True)
class DiskTierConfig:
    path: str
    capacity_bytes: int
    fsync: bool = False
    """fsync each file and its directory before a write counts as done (survives power loss)."""
    o_direct: bool = True
    """Bypass the page cache where the filesystem allows it."""
    mode: int = 0o600
    """Permissions of chunk files; directories get the same plus search (0700 for 0600)."""
    group: int | None = None
    """Group id of the directory and its files (None: the owning process's)."""
    codec: str = "none"
    """Store KV chunks through this codec (``fp8``, ``int8``, ``int4``: lossy, 2-4x more chunks in
    the same bytes; see :mod:`kvtier.tiers.codecs`), or ``auto``: the one that loads fastest on
    this disk within ``max_kl`` (:mod:`kvtier.core.codec_choice`, measured when the tier opens).
    Chunks of any codec are read back."""
    max_kl: float = DEFAULT_MAX_KL
    """``auto``'s quality budget: the largest mean KL (nats) a codec may cost."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"disk path must be a non-empty path, got {self.path!r}")
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ValueError(f"disk capacity_bytes must be a positive int, got {self.capacity_bytes!r}")
        for name in ("fsync", "o_direct"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"disk {name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.mode, int) or not 0 <= self.mode <= 0o777 or self.mode & 0o600 != 0o600:
            raise ValueError(f"disk mode must be a file mode that the owner can read and write "
                             f"(like 0o600 or 0o640), got {self.mode!r}")
        if self.group is not None and (not isinstance(self.group, int) or self.group < 0):
            raise ValueError(f"disk group must be a group id, got {self.group!r}")
        if self.codec != "auto" and self.codec not in CODECS:
            raise ValueError(f"disk: codec must be one of {[*CODECS, 'auto']}, got {self.codec!r}")
        if not isinstance(self.max_kl, (int, float)) or isinstance(self.max_kl, bool) or not self.max_kl >= 0:
            raise ValueError(f"disk max_kl must be a number >= 0, got {self.max_kl!r}")

    @property
    def dir_mode(self) -> int:
        return self.mode | ((self.mode & 0o444) >> 2)
