"""Host DRAM tier: one preallocated arena carved into fixed-size slots.

No allocation per chunk: the arena is mapped once and a chunk takes one slot. Slots are
page-aligned (so an SSD read with O_DIRECT can land straight in a slot). ``view`` returns a
zero-copy torch tensor over a pinned entry's slot.

Slot sizes. A store of one model (``slot_bytes`` given) carves the whole arena into slots of
that size. A store daemon serving any model (``slot_bytes`` None) hands memory to each entry
size an *extent* at a time: the arena is cut into extents of ``extent_bytes``; an extent holds
slots of one size no larger than it, and goes back to the pool for any size once they are all
free; a slot larger than an extent takes a run of whole contiguous extents of its own. To make
room for a size that has no free slot, the store evicts the region (extent, or run) holding the
policy's victim (:meth:`HostTier.region_keys`); each region keeps its own members, so asking
about one costs its entries, not the arena's.

The arena is a memory mapping: anonymous by default, or a named POSIX shared-memory object
(``/dev/shm/<shm_name>``) that other processes can map with :meth:`HostArena.attach`, so a store
daemon can own it while clients read and write chunk bytes in place. A shared arena is allocated
in full when it is created (``posix_fallocate``), so a ``/dev/shm`` too small for it fails there,
with a message saying so, rather than as a SIGBUS in a client's first write. On CUDA machines
the arena is registered as pinned (page-locked) memory so host<->device copies run at full speed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers.arena import PAGE, HostArena
from kvtier.tiers.base import (
    EntryExistsError,
    Reservation,
    Tier,
    TierFullError,
    check_key,
    round_up,
)
from kvtier.tiers.codecs import KVFormat

log = logging.getLogger(__name__)

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


@dataclass(slots=True)
class _Slot:
    offset: int
    nbytes: int
    stride: int
    segment: int
    fmt: KVFormat | None = None
    """What the bytes are when they are KV (a lower tier with a codec compresses them)."""
    tenant: str = ""
    """Whose chunk it is: it goes down to SSD and the remote tier with it."""


@dataclass(slots=True)
class _SizeClass:
    stride: int
    free: dict[int, list[int]] = field(default_factory=dict)
    """Per extent it holds: its free slot offsets."""
    used: dict[int, int] = field(default_factory=dict)
    """Per extent it holds: slots in use (reserved or committed)."""

    def free_slots(self, draining: set[int] | frozenset[int] = frozenset()) -> int:
        """Free slots, but those of extents being emptied (they are not handed out)."""
        return sum(len(f) for e, f in self.free.items() if e not in draining)


class HostTier(Tier):
    """DRAM tier of fixed slots (one size, or sizes sharing extents; see the module docstring)."""

    name = "host"

    def __init__(self, config: HostTierConfig, slot_bytes: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.slot_bytes = slot_bytes
        self._classes: dict[int, _SizeClass] = {}
        if slot_bytes is not None:  # one size over the whole arena
            if slot_bytes <= 0:
                raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
            self.slot_stride = round_up(slot_bytes, PAGE)
            num_slots = config.capacity_bytes // self.slot_stride
            if num_slots == 0:
                raise ValueError(
                    f"host capacity of {config.capacity_bytes} bytes is smaller than one chunk slot "
                    f"({self.slot_stride} bytes)"
                )
            self.extent_bytes = num_slots * self.slot_stride
            self.num_extents = 1
            cls = _SizeClass(self.slot_stride)
            cls.free[0] = list(range((num_slots - 1) * self.slot_stride, -1, -self.slot_stride))
            cls.used[0] = 0
            self._classes[self.slot_stride] = cls
            self._extents = bytearray(1)  # the one extent, the class's for good
        else:
            self.slot_stride = 0
            self.extent_bytes = round_up(config.extent_bytes or default_extent_bytes(config.capacity_bytes))
            self.num_extents = config.capacity_bytes // self.extent_bytes
            if self.num_extents == 0:
                raise ValueError(f"host capacity of {config.capacity_bytes} bytes is smaller than "
                                 f"one extent of {self.extent_bytes} bytes")
            self._extents = bytearray(b"\x01" * self.num_extents)  # 1: free
        self._free_extents = self._extents.count(1)
        self.arena = HostArena(self.num_extents * self.extent_bytes, config.shm_name,
                               mode=config.shm_mode, gid=config.shm_gid)
        pin = torch.cuda.is_available() if config.pin_memory is None else config.pin_memory
        if pin:
            self.arena.pin()
        self._entries: OrderedDict[ChunkKey, _Slot] = OrderedDict()
        self._reserved: dict[ChunkKey, _Slot] = {}
        self._used = 0
        self._draining: set[int] = set()
        self._regions: dict[int, dict[ChunkKey, None]] = {}
        """Per region (its first extent's index): its reserved and committed keys, committed
        ones in commit order -- so a victim's region is found without scanning every entry."""

    @property
    def num_slots(self) -> int:
        """Slots of a one-size arena (0 for an arena shared by several sizes)."""
        return self.extent_bytes // self.slot_stride if self.slot_stride else 0

    @property
    def capacity(self) -> int:
        return self.num_extents * self.extent_bytes

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def stride_for(self, nbytes: int) -> int:
        """The slot size an entry of ``nbytes`` takes; ValueError if none can hold it."""
        if self.slot_stride:
            if nbytes > self.slot_stride:
                raise ValueError(f"host: entry of {nbytes} bytes is larger than the slot size {self.slot_bytes}")
            return self.slot_stride
        stride = round_up(nbytes, PAGE)
        if stride > self.extent_bytes:  # a run of whole extents
            stride = -(-stride // self.extent_bytes) * self.extent_bytes
        if stride > self.capacity:
            raise ValueError(f"host: an entry of {nbytes} bytes does not fit in the DRAM tier of "
                             f"{self.capacity} bytes")
        return stride

    def footprint(self, nbytes: int, segment_bytes: int | None = None) -> int:
        return self.stride_for(nbytes)

    def _runs(self, extents: int, want: int) -> int:
        """How many disjoint runs of ``extents`` free extents there are (counting up to ``want``)."""
        runs, pos, pattern = 0, 0, b"\x01" * extents
        while runs < want:
            i = self._extents.find(pattern, pos)
            if i < 0:
                break
            runs += 1
            pos = i + extents
        return runs

    def has_room(self, nbytes: int, count: int = 1) -> bool:
        """Whether ``count`` more entries of ``nbytes`` fit now (free slots of their size, or
        free extents)."""
        stride = self.stride_for(nbytes)
        with self._lock:
            if stride > self.extent_bytes:
                return self._runs(stride // self.extent_bytes, count) >= count
            cls = self._classes.get(stride)
            free = cls.free_slots(self._draining) if cls is not None else 0
            return free + self._free_extents * (self.extent_bytes // stride) >= count

    def fits(self, nbytes: int, count: int) -> bool:
        """Whether ``count`` entries of ``nbytes`` could be held at all."""
        stride = self.stride_for(nbytes)
        if stride > self.extent_bytes:
            return count <= self.num_extents // (stride // self.extent_bytes)
        return count <= self.num_extents * (self.extent_bytes // stride)

    # -- regions (extents, or runs of them), for making room for another size ------------------
    def _region(self, slot: _Slot) -> tuple[int, int]:
        """Byte range of the region holding ``slot``: its extent, or its own run."""
        if slot.stride > self.extent_bytes:
            return slot.offset, slot.offset + slot.stride
        lo = slot.offset - slot.offset % self.extent_bytes
        return lo, lo + self.extent_bytes

    def _region_index(self, slot: _Slot) -> int:
        return self._region(slot)[0] // self.extent_bytes

    def _join_region(self, key: ChunkKey, slot: _Slot) -> None:
        """``key`` took ``slot`` (reserved), or committed it: (last) in its region's members."""
        members = self._regions.setdefault(self._region_index(slot), {})
        members.pop(key, None)
        members[key] = None

    def _leave_region(self, key: ChunkKey, slot: _Slot) -> None:
        region = self._region_index(slot)
        members = self._regions.get(region)
        if members is not None:
            members.pop(key, None)
            if not members:
                del self._regions[region]

    def region_of(self, key: ChunkKey) -> int | None:
        with self._lock:
            slot = self._entries.get(key) or self._reserved.get(key)
            return self._region_index(slot) if slot is not None else None

    def region_serves(self, key: ChunkKey, nbytes: int) -> bool:
        """Whether evicting ``key`` alone frees a slot an entry of ``nbytes`` can take."""
        with self._lock:
            slot = self._entries.get(key)
            return slot is not None and slot.stride == self.stride_for(nbytes)

    def _region_entries(self, region: int) -> list[tuple[ChunkKey, _Slot, bool]]:
        """The region's entries: committed ones (in commit order), then reserved ones
        (``True``). Its own members only: O(entries of the region), not of the arena."""
        members = self._regions.get(region, {})
        out = [(k, s, False) for k in members if (s := self._entries.get(k)) is not None]
        return out + [(k, s, True) for k in members if (s := self._reserved.get(k)) is not None]

    def region_keys(self, region: int) -> list[ChunkKey]:
        """Committed entries in region ``region`` (an extent's index)."""
        with self._lock:
            return [k for k, _, reserved in self._region_entries(region) if not reserved]

    def drain(self, region: int, on: bool = True) -> None:
        """While a region is being emptied for another size, its free slots are not handed out
        (they would keep it from ever becoming free)."""
        with self._lock:
            if on:
                self._draining.add(region)
            else:
                self._draining.discard(region)

    def region_busy(self, region: int) -> bool:
        """Whether region ``region`` holds a reservation or a pinned entry (it cannot be
        emptied now)."""
        with self._lock:
            return any(reserved or self._pins.get(k) for k, _, reserved in self._region_entries(region))

    def _slot_view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.arena.tensor[offset : offset + nbytes]

    def _take_extents(self, n: int) -> int:
        i = self._extents.find(b"\x01" * n)
        if i < 0:
            raise TierFullError(f"host: no run of {n} free extents")
        self._extents[i : i + n] = bytes(n)
        self._free_extents -= n
        return i

    def _give_extents(self, first: int, n: int) -> None:
        self._extents[first : first + n] = b"\x01" * n
        self._free_extents += n

    def _take_slot(self, stride: int) -> int:
        E = self.extent_bytes
        if stride > E:  # a run of whole extents, its own
            offset = self._take_extents(stride // E) * E
            self._used += stride
            return offset
        cls = self._classes.get(stride)
        if cls is None:
            cls = self._classes[stride] = _SizeClass(stride)
        exts = [e for e, f in cls.free.items() if f and e not in self._draining]
        if exts:
            ext = min(exts, key=lambda e: len(cls.free[e]))  # pack: the fullest extent first
        else:
            ext = self._take_extents(1) if not self.slot_stride else -1
            if ext < 0:
                raise TierFullError(f"host: all {self.num_slots} slots are in use")
            base, n = ext * E, E // stride
            cls.free[ext] = list(range(base + (n - 1) * stride, base - 1, -stride))
            cls.used[ext] = 0
        cls.used[ext] += 1
        self._used += stride
        return cls.free[ext].pop()

    def _give_slot(self, slot: _Slot) -> None:
        E = self.extent_bytes
        self._used -= slot.stride
        if slot.stride > E:
            self._give_extents(slot.offset // E, slot.stride // E)
            return
        cls = self._classes[slot.stride]
        ext = slot.offset // E
        cls.free[ext].append(slot.offset)
        cls.used[ext] -= 1
        if not self.slot_stride and cls.used[ext] == 0:  # an empty extent serves any size again
            del cls.free[ext], cls.used[ext]
            self._give_extents(ext, 1)

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
