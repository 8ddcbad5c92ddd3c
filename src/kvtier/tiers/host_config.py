"""The host DRAM tier's configuration (:class:`HostTierConfig`), checked when it is made, and
the default size of its extents."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.tiers.arena import PAGE
from kvtier.tiers.base import round_up

MIN_EXTENT = 64 << 10
MAX_EXTENT = 256 << 20


def default_extent_bytes(capacity: int) -> int:
    """A 64th of the arena, within [64 KiB, 256 MiB], in whole pages: slots up to an extent lose
    at most one slot per extent to rounding, larger ones at most one extent each."""
    return round_up(min(max(capacity // 64, MIN_EXTENT), MAX_EXTENT))


@dataclass(frozen=True)
class HostTierConfig:
    capacity_bytes: int
    shm_name: str | None = None
    """Put the arena in shared memory under this name (``/dev/shm/<name>``); None: private."""
    pin_memory: bool | None = None
    """Page-lock the arena for fast device copies; None: when CUDA is available."""
    extent_bytes: int | None = None
    """For an arena shared by entries of several sizes (a daemon serving any model): memory
    moves between sizes in extents of this many bytes. Default: :func:`default_extent_bytes`."""
    shm_mode: int = 0o600
    """Permissions of a shared arena (clients of other users need group read/write)."""
    shm_gid: int | None = None
    """Group of a shared arena (None: the creating process's)."""

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ValueError(f"host capacity_bytes must be a positive int, got {self.capacity_bytes!r}")
        if self.shm_name is not None and (not self.shm_name or "/" in self.shm_name):
            raise ValueError(f"host shm_name must be a plain name without '/', got {self.shm_name!r}")
        if self.extent_bytes is not None and (
                not isinstance(self.extent_bytes, int) or self.extent_bytes < PAGE):
            raise ValueError(f"host extent_bytes must be an int of at least {PAGE}, got {self.extent_bytes!r}")
        if not isinstance(self.shm_mode, int) or not 0 <= self.shm_mode <= 0o777:
            raise ValueError(f"host shm_mode must be a permission mode like 0o660, got {self.shm_mode!r}")
