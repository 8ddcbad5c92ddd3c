import errno
import functools
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.disk_format import header_len_for

from .tier_contract import ENTRY, SEGMENT, TierContract, data, key


class TestDiskTierContract(TierContract):
    @pytest.fixture(autouse=True)
    def _dir(self, tmp_path):
        self.dir = tmp_path / "ssd"

    def make_tier(self, capacity_entries: int) -> DiskTier:
        per_entry = header_len_for(ENTRY // SEGMENT) + ENTRY
        return DiskTier(DiskTierConfig(str(self.dir), capacity_entries * per_entry))


class TestDiskTierContractBuffered(TestDiskTierContract):
    """The same contract with the page cache and with fsync."""

    def make_tier(self, capacity_entries: int) -> DiskTier:
        per_entry = header_len_for(ENTRY // SEGMENT) + ENTRY
        return DiskTier(DiskTierConfig(str(self.dir), capacity_entries * per_entry, fsync=True, o_direct=False))


def open_tier(path, capacity=1 << 30, **kw) -> DiskTier:
    return DiskTier(DiskTierConfig(str(path), capacity, **kw))


def chunk_file(tier: DiskTier, i: int) -> str:
    return tier._path(key(i))


def test_a_reopened_directory_serves_every_chunk_byte_for_byte(tmp_path):
    with open_tier(tmp_path) as tier:
        for i in range(5):
            tier.put(key(i), data(i), SEGMENT)
        used = tier.used
    with open_tier(tmp_path) as tier:
        assert tier.keys() == [key(i) for i in range(5)]  # oldest first
        assert tier.used == used
        for i in range(5):
            assert torch.equal(tier.get(key(i)), data(i))


def test_one_corrupted_byte_is_a_counted_miss_never_wrong_bytes(tmp_path, caplog):
    with open_tier(tmp_path) as tier:
        tier.put(key(1), data(1), SEGMENT)
        tier.put(key(2), data(2), SEGMENT)
        path = chunk_file(tier, 1)
        with open(path, "r+b") as f:  # flip one payload byte in segment 2
            pos = header_len_for(4) + 2 * SEGMENT + 17
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 0x01]))
        # the untouched segments of the damaged chunk still verify on their own
        assert torch.equal(tier.get(key(1), offset=0, length=SEGMENT), data(1)[:SEGMENT])
        assert tier.get(key(1)) is None
        assert tier.stats.corrupt == 1 and tier.stats.errors == 1 and tier.stats.misses == 1
        assert "checksum mismatch in segment 2" in caplog.text
        assert tier.flush_deletes()  # the damaged file is unlinked in the background
        assert not tier.contains(key(1)) and not os.path.exists(path)
        assert torch.equal(tier.get(key(2)), data(2))  # nothing else lost


def test_missing_and_truncated_files_are_misses(tmp_path):
    with open_tier(tmp_path) as tier:
        for i in range(3):
            tier.put(key(i), data(i), SEGMENT)
        os.unlink(chunk_file(tier, 0))
        os.truncate(chunk_file(tier, 1), header_len_for(4) + SEGMENT)
        assert tier.get(key(0)) is None
        assert tier.get(key(1)) is None
        assert tier.stats.errors == 2 and not tier.contains(key(0)) and not tier.contains(key(1))
        assert torch.equal(tier.get(key(2)), data(2))


def test_damaged_files_are_dropped_on_reopen(tmp_path):
    with open_tier(tmp_path) as tier:
        for i in range(4):
            tier.put(key(i), data(i), SEGMENT)
        paths = [chunk_file(tier, i) for i in range(4)]
    with open(paths[0], "r+b") as f:  # header damage
        f.seek(40)
        f.write(b"\xff\xff")
    os.truncate(paths[1], 4096 + 100)  # truncated payload
    os.rename(paths[2], paths[2].replace(key(2).hex(), key(9).hex()))  # name does not match key
    with open_tier(tmp_path) as tier:
        assert tier.keys() == [key(3)]
        assert tier.stats.corrupt == 3
        assert all(not os.path.exists(p) for p in paths[:2])


def test_o_direct_falls_back_cleanly_where_unsupported(tmp_path, monkeypatch, caplog):
    # Fault injection: a filesystem that refuses O_DIRECT at open (as older tmpfs, FUSE do).
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with open_tier(tmp_path, o_direct=True) as tier:
        assert tier.put(key(1), data(1), SEGMENT)
        assert not tier.direct_io
        assert torch.equal(tier.get(key(1)), data(1))
    assert "O_DIRECT not supported" in caplog.text


def test_direct_io_reads_into_an_aligned_buffer_and_an_unaligned_one(tmp_path):
    with open_tier(tmp_path) as tier:
        tier.put(key(1), data(1), SEGMENT)
        aligned = torch.empty(ENTRY + 4096, dtype=torch.uint8)
        off = (-aligned.data_ptr()) % 4096
        out = aligned[off : off + ENTRY]
        assert torch.equal(tier.get(key(1), out=out), data(1))
        odd = torch.empty(ENTRY + 1, dtype=torch.uint8)[1:]
        assert torch.equal(tier.get(key(1), out=odd), data(1))


def test_unwritable_directory_and_bad_config_raise_clearly(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="not writable"):
        open_tier(afile / "cache")
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTierConfig(str(tmp_path), 0)
    with pytest.raises(ValueError, match="path"):
        DiskTierConfig("", 100)


def test_one_process_owns_a_directory(tmp_path):
    with open_tier(tmp_path), pytest.raises(ValueError, match="in use by another process"):
        open_tier(tmp_path)
    open_tier(tmp_path).close()  # free again once closed


WRITER = r"""
import sys, torch
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_config import DiskTierConfig
tier = DiskTier(DiskTierConfig(sys.argv[1], 1 << 40))
base = torch.randint(0, 256, (int(sys.argv[2]),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
i = 0
while True:
    base[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
    assert tier.put(i.to_bytes(16, "little"), base, 1 << 20)
    print(i, flush=True)
    i += 1
"""


@functools.lru_cache(maxsize=1)
def _writer_base(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def expected_bytes(i: int, n: int) -> torch.Tensor:
    base = _writer_base(n).clone()
    base[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
    return base


@pytest.mark.slow
def test_sigkill_mid_write_keeps_exactly_the_completed_chunks(tmp_path):
    size = 32 << 20  # big enough that most of a put is the write itself
    partial_seen = 0
    # A kill lands mid-write only by chance (the writer also spends time copying and hashing),
    # so go on until one has, with at least 3 rounds and at most 12.
    for round_ in range(12):
        if round_ >= 3 and partial_seen:
            break
        d = tmp_path / f"r{round_}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(size)], stdout=subprocess.PIPE, text=True)
        reported = []
        while len(reported) < 3 + round_ % 4:
            line = proc.stdout.readline()
            assert line, "writer died"
            reported.append(int(line))
        time.sleep(0.004 * (round_ % 8))  # spread the kill over copy, hash, write and rename
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        reported += [int(x) for x in proc.stdout.read().split()]
        partial_seen += len(os.listdir(d / "tmp")) > 0
        with open_tier(d) as tier:
            present = sorted(int.from_bytes(k, "little") for k in tier.keys())
            # every reported chunk is there; at most the one in flight was also completed
            assert set(reported) <= set(present) <= set(reported) | {max(reported) + 1}, (reported, present)
            for i in present:
                assert torch.equal(tier.get(key(i)), expected_bytes(i, size)), f"chunk {i} differs"
            assert os.listdir(d / "tmp") == []  # partial files cleaned up
        shutil.rmtree(d)
    assert partial_seen > 0, "no kill landed mid-write; the test did not exercise a partial file"


@pytest.mark.parametrize("err", [errno.EMFILE, errno.EIO, errno.EFAULT, errno.ENOMEM])
def test_a_read_failing_for_a_reason_of_the_machine_is_a_miss_that_keeps_the_chunk(tmp_path, monkeypatch, err, caplog):
    with open_tier(tmp_path) as tier:
        tier.put(key(1), data(1), SEGMENT)
        real = os.preadv
        calls = []

        def failing(fd, bufs, pos):  # fault: out of file descriptors, a bad disk sector, a fault
            calls.append(1)
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(os, "preadv", failing)
        assert tier.get(key(1)) is None
        assert tier.stats.misses == 1 and tier.stats.errors == 1 and tier.stats.corrupt == 0
        assert "the file is kept" in caplog.text
        monkeypatch.setattr(os, "preadv", real)
        assert tier.contains(key(1)) and os.path.exists(chunk_file(tier, 1))
        assert torch.equal(tier.get(key(1)), data(1))  # nothing was lost


def test_an_open_failing_with_emfile_keeps_the_chunk(tmp_path, monkeypatch):
    with open_tier(tmp_path) as tier:
        tier.put(key(1), data(1), SEGMENT)
        real = os.open

        def emfile(path, flags, *args):
            if str(path).endswith(".kvc") and not flags & os.O_WRONLY:
                raise OSError(errno.EMFILE, "Too many open files")
            return real(path, flags, *args)

        monkeypatch.setattr(os, "open", emfile)
        assert tier.get(key(1)) is None
        monkeypatch.setattr(os, "open", real)
        assert torch.equal(tier.get(key(1)), data(1))


def test_recovery_skips_what_is_not_a_regular_file(tmp_path):
    with open_tier(tmp_path) as tier:
        tier.put(key(1), data(1), SEGMENT)
        fifo = os.path.join(os.path.dirname(chunk_file(tier, 2)), key(2).hex() + ".kvc")
    os.mkfifo(fifo)  # a FIFO named like a chunk: opening it would hang the start
    os.symlink("/etc/passwd", fifo.replace(key(2).hex(), key(3).hex()))
    with open_tier(tmp_path) as tier:  # returns at once
        assert tier.keys() == [key(1)]
    assert os.path.exists(fifo)  # skipped, not deleted


def test_files_are_private_and_positions_survive_a_reopen(tmp_path):
    import stat as st

    with open_tier(tmp_path) as tier:
        tier.put(key(1), data(1), SEGMENT, position=7)
        tier.put(key(2), data(2), SEGMENT)
        path = chunk_file(tier, 1)
    assert st.S_IMODE(os.stat(path).st_mode) == 0o600
    assert st.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    with open_tier(tmp_path) as tier:
        assert tier.position_of(key(1)) == 7 and tier.position_of(key(2)) is None


def test_deleted_files_go_in_the_background_and_the_key_waits_for_it(tmp_path):
    with open_tier(tmp_path) as tier:
        tier.put(key(1), data(1), SEGMENT)
        path = chunk_file(tier, 1)
        assert tier.delete(key(1))
        assert not tier.contains(key(1)) and tier.used == 0
        assert tier.flush_deletes()
        assert not os.path.exists(path)
        assert tier.put(key(1), data(1), SEGMENT)  # written again once the old file is gone


def test_a_chunks_tenant_is_in_its_header_and_survives_a_reopen(tmp_path):
    """Whose chunk it is lives in the file (version 4 header), so a restarted store knows where
    the chunk goes when it leaves SSD; a chunk without a tenant keeps the older format."""
    with open_tier(tmp_path) as tier:
        assert tier.put(key(1), data(1), SEGMENT, tenant="acme")
        assert tier.put(key(2), data(2), SEGMENT)
        assert tier.put(key(3), data(3), SEGMENT, tenant="ünïcode tenant")
        assert [tier.tenant_of(key(i)) for i in (1, 2, 3, 4)] == ["acme", "", "ünïcode tenant", None]
    versions = {}
    for i in (1, 2, 3):
        with open(chunk_file(tier, i), "rb") as f:
            versions[i] = int.from_bytes(f.read(6)[4:6], "little")
    assert versions == {1: 4, 2: 2, 3: 4}
    with open_tier(tmp_path) as tier:
        assert [tier.tenant_of(key(i)) for i in (1, 2, 3)] == ["acme", "", "ünïcode tenant"]
        for i in (1, 2, 3):
            assert torch.equal(tier.get(key(i)), data(i))


def test_a_damaged_tenant_field_is_a_miss_and_long_tenants_are_refused(tmp_path):
    with open_tier(tmp_path) as tier:
        assert tier.put(key(1), data(1), SEGMENT, tenant="acme")
        path = chunk_file(tier, 1)
    with open(path, "r+b") as f:  # "acme" -> "acmf": the header checksum catches it
        raw = f.read(4096)
        at = raw.index(b"acme")
        f.seek(at + 3)
        f.write(b"f")
    with open_tier(tmp_path) as tier:
        assert not tier.contains(key(1)) and tier.get(key(1)) is None
        with pytest.raises(ValueError, match="tenant name is at most 512 bytes"):
            tier.put(key(2), data(2), SEGMENT, tenant="x" * 513)
        assert not tier.contains(key(2))


@pytest.mark.parametrize("segments, tenant", [(600, ""), (460, "t" * 512)])
def test_a_header_longer_than_a_page_survives_a_reopen(tmp_path, segments, tenant):
    """8 bytes of checksum a segment: a chunk of many layers (or a long tenant name) has a
    header past the first page, which reopening used to call damage and delete."""
    payload = torch.arange(segments * 64, dtype=torch.int32).view(torch.uint8)[: segments * 256].clone()
    with open_tier(tmp_path) as tier:
        assert tier.put(key(1), payload, 256, tenant=tenant)
        assert header_len_for(segments, tenant_bytes=len(tenant)) > 4096
    with open_tier(tmp_path) as tier:
        assert tier.contains(key(1)) and tier.stats.corrupt == 0
        assert torch.equal(tier.get(key(1)), payload) and tier.tenant_of(key(1)) == tenant
