import os
import subprocess
import sys
import uuid

import pytest
import torch

from kvtier.tiers.base import TierFullError
from kvtier.tiers.host import SHM_DIR, HostArena, HostTier, HostTierConfig

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
            "from kvtier.tiers.host import HostArena\n"
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
        "from kvtier.tiers.host import HostArena\n"
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
