"""Host DRAM tier: one preallocated arena carved into fixed-size slots.

No allocation per chunk: the arena is mapped once and a chunk takes one slot. Slots are
page-aligned (so an SSD read with O_DIRECT can land straight in a slot). ``view`` returns a
zero-copy torch tensor over a pinned entry's slot.

How slots are carved (one size, or sizes sharing extents) and the regions evicted to make room
for another size: :mod:`kvtier.tiers.host_slots`.

The arena is a memory mapping: anonymous by default, or a named POSIX shared-memory object
(``/dev/shm/<shm_name>``) that other processes can map with :meth:`HostArena.attach`, so a store
daemon can own it while clients read and write chunk bytes in place. A shared arena is allocated
in full when it is created (``posix_fallocate``), so a ``/dev/shm`` too small for it fails there,
with a message saying so, rather than as a SIGBUS in a client's first write. On CUDA machines
the arena is registered as pinned (page-locked) memory so host<->device copies run at full speed.
"""

from __future__ import annotations

import logging

import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import EntryExistsError, Reservation, check_key
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.host_slots import HostSlots, _Slot

log = logging.getLogger(__name__)


class HostTier(HostSlots):
    """DRAM tier of fixed slots (one size, or sizes sharing extents; see
    :mod:`kvtier.tiers.host_slots`)."""

    name = "host"

    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None,
                slot_bytes: int | None = None, fmt: KVFormat | None = None, tenant: str = "") -> Reservation:
        """Take a slot for ``key``. ``slot_bytes``: the slot size to take (a part of a typed
        object, smaller than a chunk, still takes a chunk's slot); default: ``nbytes``.
        ``fmt``: what the bytes are when they are KV, kept for :meth:`format_of`; ``tenant``:
        whose chunk it is, kept for :meth:`tenant_of`."""
        key = check_key(key)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"host: entry size must be a positive int, got {nbytes!r}")
        stride = self.stride_for(max(nbytes, slot_bytes or 0))
        with self._lock:
            if key in self._entries or key in self._reserved:
                raise EntryExistsError(f"host: chunk {key.hex()} is already stored or being written")
            offset = self._take_slot(stride)
            slot = _Slot(offset, nbytes, stride, segment_bytes or nbytes, fmt, tenant)
            self._reserved[key] = slot
            self._join_region(key, slot)
        return Reservation(key, nbytes, segment_bytes or nbytes, self._slot_view(offset, nbytes), offset)

    def commit(self, reservation: Reservation, ok: bool = True) -> bool:
        with self._lock:
            slot = self._reserved.get(reservation.key)
            if slot is None or slot.offset != reservation.slot:
                raise ValueError(f"host: no open reservation for chunk {reservation.key.hex()}")
            del self._reserved[reservation.key]
            if not ok:
                self._leave_region(reservation.key, slot)
                self._give_slot(slot)
                return False
            self._entries[reservation.key] = slot
            self._join_region(reservation.key, slot)  # last: commit order
            self.stats.writes += 1
            self.stats.bytes_written += reservation.nbytes
            return True

    def reserving(self, key: ChunkKey) -> bool:
        """Whether ``key`` has an open reservation (is being written)."""
        with self._lock:
            return key in self._reserved

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
                slot = self._entries[key]
            length = slot.nbytes - offset if length is None else length
            if offset < 0 or length < 0 or offset + length > slot.nbytes:
                raise ValueError(f"host: range [{offset}, {offset + length}) outside entry of {slot.nbytes} bytes")
            src = self._slot_view(slot.offset, slot.nbytes)[offset : offset + length]
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
            slot = self._entries[key]
            self.stats.hits += 1
            self.stats.bytes_read += slot.nbytes
        return self._slot_view(slot.offset, slot.nbytes)

    def slot_of(self, key: ChunkKey) -> int | None:
        """Byte offset of a committed entry in the arena (for processes that map it)."""
        with self._lock:
            slot = self._entries.get(key)
            return slot.offset if slot else None

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._entries

    def entry_bytes(self, key: ChunkKey) -> int | None:
        with self._lock:
            slot = self._entries.get(key)
            return slot.nbytes if slot else None

    def segment_of(self, key: ChunkKey) -> int | None:
        """The checksummed part size the entry was reserved with (a layer of a chunk)."""
        with self._lock:
            slot = self._entries.get(key)
            return slot.segment if slot else None

    def format_of(self, key: ChunkKey) -> KVFormat | None:
        """The KV format the entry was reserved with (None: not KV, or not said)."""
        with self._lock:
            slot = self._entries.get(key)
            return slot.fmt if slot else None

    def tenant_of(self, key: ChunkKey) -> str | None:
        """The tenant a committed (or reserved) entry was stored for; None if absent."""
        with self._lock:
            slot = self._entries.get(key) or self._reserved.get(key)
            return slot.tenant if slot else None

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def _delete_unpinned(self, key: ChunkKey) -> bool:
        slot = self._entries.pop(key, None)
        if slot is None:
            return False
        self._leave_region(key, slot)
        self._give_slot(slot)
        return True

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._reserved.clear()
            self._regions.clear()
            self._classes.clear()
            self.arena.close()
