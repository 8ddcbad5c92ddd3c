import os
import random
import subprocess
import sys
import uuid

import pytest
import torch

from kvtier.tiers.arena import SHM_DIR, HostArena
from kvtier.tiers.base import TierFullError
from kvtier.tiers.host import HostTier
from kvtier.tiers.host_config import HostTierConfig

from .tier_contract import ENTRY, TierContract, data, key


class TestHostTierContract(TierContract):
    def make_tier(self, capacity_entries: int) -> HostTier:
        return HostTier(HostTierConfig(capacity_bytes=capacity_entries * ENTRY), slot_bytes=ENTRY)


def test_slots_are_page_aligned_and_capacity_rounds_down_to_whole_slots():
    tier = HostTier(HostTierConfig(capacity_bytes=3 * 8192 + 100), slot_bytes=5000)
    assert tier.slot_stride == 8192 and tier.num_slots == 3 and tier.capacity == 3 * 8192
    tier.put(key(1), data(1, 5000))
    with tier.pinned(key(1)):
        assert tier.view(key(1)).data_ptr() % 4096 == 0
    tier.close()


def test_view_is_zero_copy_and_needs_a_pin():
    tier = HostTier(HostTierConfig(capacity_bytes=2 * ENTRY), slot_bytes=ENTRY)
    tier.put(key(1), data(1))
    with pytest.raises(RuntimeError, match="without a pin"):
        tier.view(key(1))
    with tier.pinned(key(1)):
        v = tier.view(key(1))
        assert v.data_ptr() == tier.arena.tensor.data_ptr() + tier.slot_of(key(1))  # a byte offset
        v.view(torch.float32)[0] = 1.5  # torch can use the view in place, as another dtype
        assert tier.get(key(1), length=4).view(torch.float32).item() == 1.5
    tier.close()


def test_entries_larger_than_a_slot_and_tiers_smaller_than_one_are_refused():
    with pytest.raises(ValueError, match="smaller than one chunk slot"):
        HostTier(HostTierConfig(capacity_bytes=ENTRY - 1), slot_bytes=ENTRY)
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="capacity_bytes"):
            HostTierConfig(capacity_bytes=bad)  # type: ignore[arg-type]
    tier = HostTier(HostTierConfig(capacity_bytes=4 * ENTRY), slot_bytes=ENTRY)
    with pytest.raises(ValueError, match="larger than the slot size"):
        tier.reserve(key(1), ENTRY + 1)
    tier.close()


def test_the_arena_can_live_in_shared_memory_mapped_by_another_process():
    name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    tier = HostTier(HostTierConfig(capacity_bytes=4 * ENTRY, shm_name=name), slot_bytes=ENTRY)
    try:
        tier.put(key(1), data(1))
        slot = tier.slot_of(key(1))
        code = (
            "import sys, torch\n"
            "from kvtier.tiers.arena import HostArena\n"
            f"a = HostArena.attach({name!r}, {tier.arena.size})\n"
            f"seg = a.tensor[{slot}:{slot + ENTRY}]\n"
            "print(int(seg.sum()))\n"
            "seg[:4] = torch.tensor([9, 8, 7, 6], dtype=torch.uint8)\n"  # write in place
            "a.close()\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert int(out.stdout) == int(data(1).sum())
        assert tier.get(key(1), length=4).tolist() == [9, 8, 7, 6]
        with pytest.raises(ValueError, match="already exists"):
            HostArena(4096, name)
    finally:
        tier.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))  # the owner unlinks it


def test_bad_shm_name_is_refused():
    with pytest.raises(ValueError, match="shm_name"):
        HostTierConfig(capacity_bytes=ENTRY, shm_name="a/b")


def test_entries_of_several_sizes_share_the_arena_an_extent_at_a_time():
    small, big = 8192, 3 * 65536  # a big slot spans 3 extents of 64 KiB
    tier = HostTier(HostTierConfig(capacity_bytes=8 * 65536, extent_bytes=65536))
    assert tier.num_extents == 8 and tier.num_slots == 0
    for i in range(16):  # two extents of small slots
        tier.put(key(i), data(i, small))
    assert tier.has_room(big) and tier.fits(big, 2) and not tier.fits(big, 3)
    tier.put(key(100), data(100, big))  # a run of 3 contiguous extents
    assert tier.slot_of(key(100)) % 65536 == 0
    assert tier.has_room(big) and not tier.has_room(big, 2)  # 3 free extents left: one more run
    tier.put(key(101), data(101, big))
    assert not tier.has_room(big) and not tier.has_room(small)
    with pytest.raises(TierFullError):
        tier.reserve(key(102), small)
    for i in range(8):  # empty the first small extent: it serves any size again
        tier.delete(key(i))
    region = tier.region_of(key(8))
    assert tier.region_keys(region) == [key(i) for i in range(8, 16)]
    assert tier.has_room(65536) and tier.region_serves(key(8), small) and not tier.region_serves(key(8), big)
    for i in (8, 9):
        with tier.pinned(key(i)):
            assert tier.region_busy(region)
    for i in range(16, 24):
        tier.put(key(i), data(i, small))
    assert torch.equal(tier.get(key(100)), data(100, big)) and torch.equal(tier.get(key(12)), data(12, small))
    tier.close()


class _Reference:
    """What the region queries must answer, kept by the test from what it did: each live
    entry's slot offset, whether it is committed, its pins, and the commit order."""

    def __init__(self, extent: int) -> None:
        self.extent = extent
        self.offset: dict[bytes, int] = {}
        self.reserved: dict[bytes, object] = {}  # key -> its Reservation
        self.committed: list[bytes] = []  # in commit order
        self.pins: dict[bytes, int] = {}

    def region(self, k: bytes) -> int:
        return self.offset[k] // self.extent  # a small slot's extent, or a run's first one

    def keys(self, region: int) -> list[bytes]:
        return [k for k in self.committed if self.region(k) == region]

    def busy(self, region: int) -> bool:
        return any(self.region(k) == region for k in self.reserved) or any(
            self.pins.get(k) and self.region(k) == region for k in self.committed)


def test_region_queries_match_a_scan_of_every_entry_under_random_churn_and_look_at_one_region():
    """Sizes sharing the arena an extent at a time, reserved, committed, abandoned, pinned and
    deleted at random: ``region_of``, ``region_keys`` and ``region_busy`` always answer what a
    scan of every entry answers, without looking at the entries of any other region."""
    rng = random.Random(27)
    extent = 65536
    tier = HostTier(HostTierConfig(capacity_bytes=24 * extent, extent_bytes=extent))
    ref = _Reference(extent)
    scanned = []  # every entry the tier maps to its region while answering a query
    region_of_slot = tier._region
    tier._region = lambda slot: scanned.append(slot) or region_of_slot(slot)
    sizes = [4096, 8192, 12288, 16384, 65536, 2 * extent, 3 * extent]
    next_key = 0
    for step in range(4000):
        op = rng.random()
        if op < 0.35:  # a new entry
            k, next_key = key(next_key), next_key + 1
            try:
                res = tier.reserve(k, rng.choice(sizes))
            except TierFullError:
                continue
            ref.offset[k], ref.reserved[k] = res.slot, res
        elif op < 0.6 and ref.reserved:  # its write ends
            k = rng.choice(list(ref.reserved))
            ok = rng.random() < 0.85
            assert tier.commit(ref.reserved.pop(k), ok=ok) is ok
            if ok:
                ref.committed.append(k)
            else:
                del ref.offset[k]
        elif op < 0.75 and ref.committed:  # a pin, or its end
            k = rng.choice(ref.committed)
            if ref.pins.get(k) and rng.random() < 0.6:
                tier.unpin(k)
                ref.pins[k] -= 1
            else:
                assert tier.pin(k)
                ref.pins[k] = ref.pins.get(k, 0) + 1
        elif ref.committed:  # an eviction
            k = rng.choice(ref.committed)
            if ref.pins.get(k):
                continue
            assert tier.delete(k)
            ref.committed.remove(k)
            del ref.offset[k]
        if step % 50:
            continue
        scanned.clear()
        for region in range(tier.num_extents):
            assert tier.region_keys(region) == ref.keys(region), f"step {step}, region {region}"
            assert tier.region_busy(region) == ref.busy(region), f"step {step}, region {region}"
        assert scanned == []  # no entry of the arena was looked at to answer for a region
        for k in ref.offset:
            assert tier.region_of(k) == ref.region(k)
        assert len(scanned) == len(ref.offset)  # one slot each: the key's own
        members = {r: set(ks) for r, ks in tier._regions.items()}  # per region, its own keys
        assert members == {r: {k for k in ref.offset if ref.region(k) == r}
                           for r in {ref.region(k) for k in ref.offset}}
    assert len(ref.committed) > 20 and tier.free < 4 * extent  # it ran full, with many entries
    tier.close()


def test_a_size_no_extent_run_can_hold_is_refused_clearly():
    tier = HostTier(HostTierConfig(capacity_bytes=4 * 65536, extent_bytes=65536))
    with pytest.raises(ValueError, match="does not fit in the DRAM tier"):
        tier.reserve(key(1), 5 * 65536)
    tier.close()


def test_closing_an_arena_under_a_live_view_never_unmaps_it():
    """A view outlives the arena's close (an upload still running at shutdown, a client's lease
    after its daemon went): the mapping stays until the last view goes, never a SIGSEGV."""
    name = f"kvtier-{uuid.uuid4().hex}"
    code = (
        "import gc, os\n"
        "from kvtier.tiers.arena import HostArena\n"
        f"a = HostArena(1 << 20, {name!r})\n"
        "v = a.tensor[4096:8192]\n"
        "a.close()\n"
        "v.fill_(7)\n"  # unmapped memory would kill the process here
        "print(int(v.sum()))\n"
        "del v; gc.collect()\n"
        f"print({name!r} in open(f'/proc/{{os.getpid()}}/maps').read())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(7 * 4096), "False"]  # written, then unmapped with the last view
    assert not os.path.exists(os.path.join(SHM_DIR, name))
