"""The slots of the host DRAM tier (:mod:`kvtier.tiers.host`): how its arena is carved, slots
taken and given back, and the regions evicted to make room for another size.

Slot sizes. A store of one model (``slot_bytes`` given) carves the whole arena into slots of
that size. A store daemon serving any model (``slot_bytes`` None) hands memory to each entry
size an *extent* at a time: the arena is cut into extents of ``extent_bytes``; an extent holds
slots of one size no larger than it, and goes back to the pool for any size once they are all
free; a slot larger than an extent takes a run of whole contiguous extents of its own. To make
room for a size that has no free slot, the store evicts the region (extent, or run) holding the
policy's victim (:meth:`HostSlots.region_keys`); each region keeps its own members, so asking
about one costs its entries, not the arena's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers.arena import PAGE, HostArena
from kvtier.tiers.base import Tier, TierFullError, round_up
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.host_config import HostTierConfig, default_extent_bytes


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


class HostSlots(Tier):
    """The arena, slots and regions of :class:`~kvtier.tiers.host.HostTier` (see the module
    docstring); the entries in the slots are the tier's."""

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
