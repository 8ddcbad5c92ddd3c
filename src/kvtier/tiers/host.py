"""Host DRAM tier: one preallocated arena carved into fixed-size slots.

No allocation per chunk: the arena is mapped once and a chunk takes one slot. Slots are
page-aligned (so an SSD read with O_DIRECT can land straight in a slot). ``view`` returns a
zero-copy torch tensor over a pinned entry's slot.

The arena is a memory mapping: anonymous by default, or a named POSIX shared-memory object
(``/dev/shm/<shm_name>``) that other processes can map with :meth:`HostArena.attach`, so a store
daemon can own it while clients read and write chunk bytes in place. On CUDA machines the arena
is registered as pinned (page-locked) memory so host<->device copies run at full speed.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import (
    PAGE,
    EntryExistsError,
    Reservation,
    Tier,
    TierFullError,
    check_key,
    round_up,
)

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class HostTierConfig:
    capacity_bytes: int
    shm_name: str | None = None
    """Put the arena in shared memory under this name (``/dev/shm/<name>``); None: private."""
    pin_memory: bool | None = None
    """Page-lock the arena for fast device copies; None: when CUDA is available."""

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ValueError(f"host capacity_bytes must be a positive int, got {self.capacity_bytes!r}")
        if self.shm_name is not None and (not self.shm_name or "/" in self.shm_name):
            raise ValueError(f"host shm_name must be a plain name without '/', got {self.shm_name!r}")


class HostArena:
    """A page-aligned byte arena in an anonymous or shared memory mapping."""

    def __init__(self, size: int, shm_name: str | None = None, *, create: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.size = size
        self.shm_name = shm_name
        self._owner = create and shm_name is not None
        if shm_name is None:
            self._mmap = mmap.mmap(-1, size)
        else:
            path = os.path.join(SHM_DIR, shm_name)
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            try:
                fd = os.open(path, flags, 0o600)
            except FileExistsError:
                raise ValueError(f"shared-memory arena {path} already exists") from None
            try:
                if create:
                    os.ftruncate(fd, size)
                elif os.fstat(fd).st_size < size:
                    raise ValueError(f"shared-memory arena {path} is smaller than {size} bytes")
                self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED)
            finally:
                os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._registered = False

    @classmethod
    def attach(cls, shm_name: str, size: int) -> HostArena:
        """Map an arena another process created."""
        return cls(size, shm_name, create=False)

    def pin(self) -> bool:
        """Page-lock the arena for CUDA copies; False where CUDA is not available."""
        if self._registered or not torch.cuda.is_available():
            return self._registered
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
        self._registered = int(err) == 0
        if not self._registered:
            log.warning("cudaHostRegister of %d bytes failed (%s); host arena is pageable", self.size, err)
        return self._registered

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._mmap.close()
        except BufferError:
            # A caller still holds a view; the mapping goes when the last view does.
            pass
        if self._owner and self.shm_name is not None:
            try:
                os.unlink(os.path.join(SHM_DIR, self.shm_name))
            except FileNotFoundError:
                pass
            self._owner = False


class HostTier(Tier):
    """Fixed-slot DRAM tier. Every entry is at most ``slot_bytes``."""

    name = "host"

    def __init__(self, config: HostTierConfig, slot_bytes: int) -> None:
        super().__init__()
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.config = config
        self.slot_bytes = slot_bytes
        self.slot_stride = round_up(slot_bytes, PAGE)
        self.num_slots = config.capacity_bytes // self.slot_stride
        if self.num_slots == 0:
            raise ValueError(
                f"host capacity of {config.capacity_bytes} bytes is smaller than one chunk slot "
                f"({self.slot_stride} bytes)"
            )
        self.arena = HostArena(self.num_slots * self.slot_stride, config.shm_name)
        pin = torch.cuda.is_available() if config.pin_memory is None else config.pin_memory
        if pin:
            self.arena.pin()
        self._free: deque[int] = deque(range(self.num_slots))
        self._entries: OrderedDict[ChunkKey, tuple[int, int]] = OrderedDict()  # key -> (slot, n)
        self._reserved: dict[ChunkKey, int] = {}

    @property
    def capacity(self) -> int:
        return self.num_slots * self.slot_stride

    @property
    def used(self) -> int:
        with self._lock:
            return (self.num_slots - len(self._free)) * self.slot_stride

    def footprint(self, nbytes: int, segment_bytes: int | None = None) -> int:
        return self.slot_stride

    def _slot_view(self, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * self.slot_stride
        return self.arena.tensor[start : start + nbytes]

    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None) -> Reservation:
        key = check_key(key)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"host: entry size must be a positive int, got {nbytes!r}")
        if nbytes > self.slot_bytes:
            raise ValueError(
                f"host: entry of {nbytes} bytes is larger than the slot size {self.slot_bytes}"
            )
        with self._lock:
            if key in self._entries or key in self._reserved:
                raise EntryExistsError(f"host: chunk {key.hex()} is already stored or being written")
            if not self._free:
                raise TierFullError(f"host: all {self.num_slots} slots are in use")
            slot = self._free.popleft()
            self._reserved[key] = slot
        return Reservation(key, nbytes, segment_bytes or nbytes, self._slot_view(slot, nbytes), slot)

    def commit(self, reservation: Reservation, ok: bool = True) -> bool:
        with self._lock:
            slot = self._reserved.pop(reservation.key, None)
            if slot is None or slot != reservation.slot:
                raise ValueError(f"host: no open reservation for chunk {reservation.key.hex()}")
            if not ok:
                self._free.append(slot)
                return False
            self._entries[reservation.key] = (slot, reservation.nbytes)
            self.stats.writes += 1
            self.stats.bytes_written += reservation.nbytes
            return True

    def get(
        self,
        key: ChunkKey,
        out: torch.Tensor | None = None,
        offset: int = 0,
        length: int | None = None,
    ) -> torch.Tensor | None:
        with self.pinned(key) as held:
            if not held:
                self.stats.misses += 1
                return None
            with self._lock:
                slot, nbytes = self._entries[key]
            length = nbytes - offset if length is None else length
            if offset < 0 or length < 0 or offset + length > nbytes:
                raise ValueError(f"host: range [{offset}, {offset + length}) outside entry of {nbytes} bytes")
            src = self._slot_view(slot, nbytes)[offset : offset + length]
            if out is None:
                out = src.clone()
            else:
                out.copy_(src)
            self.stats.hits += 1
            self.stats.bytes_read += length
            return out

    def view(self, key: ChunkKey) -> torch.Tensor:
        """Zero-copy ``uint8`` tensor over a committed entry, counted as a read. The caller must
        hold a pin for as long as it uses the view (the slot is reused once the entry goes)."""
        with self._lock:
            if not self._pins.get(key):
                raise RuntimeError(f"host: view of chunk {key.hex()} without a pin")
            slot, nbytes = self._entries[key]
            self.stats.hits += 1
            self.stats.bytes_read += nbytes
        return self._slot_view(slot, nbytes)

    def slot_of(self, key: ChunkKey) -> int | None:
        """Slot index of a committed entry (for processes that map the shared arena)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry[0] if entry else None

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._entries

    def entry_bytes(self, key: ChunkKey) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry[1] if entry else None

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def _delete_unpinned(self, key: ChunkKey) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._free.append(entry[0])
        return True

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._reserved.clear()
            self._free.clear()
            self.arena.close()
