"""The Mooncake tier against a real mooncake_master and a mooncake_client holding the pool's
memory: the tier contract, sharing between processes, then the faults (master down at start,
killed, stalled, corrupted bytes)."""

import time

import pytest
import torch

from kvtier.tiers.base import TierFullError
from kvtier.tiers.mooncake import MooncakeTier, MooncakeTierConfig
from kvtier.tiers.remote_format import header_len
from tests.remote_servers import unique_prefix, wait_until

from .tier_contract import ENTRY, SEGMENT, TierContract, data, key, try_put

PER_ENTRY = header_len(ENTRY // SEGMENT) + ENTRY


def open_tier(master: str, capacity=1 << 30, **kw) -> MooncakeTier:
    kw.setdefault("prefix", unique_prefix())
    return MooncakeTier(MooncakeTierConfig(master, capacity, **kw))


class TestMooncakeContract(TierContract):
    @pytest.fixture(autouse=True)
    def _servers(self, mooncake_shared):
        self.master = mooncake_shared.master_address

    def make_tier(self, capacity_entries: int) -> MooncakeTier:
        return open_tier(self.master, capacity_entries * PER_ENTRY)


def test_two_processes_see_each_others_chunks(mooncake_shared):
    prefix = unique_prefix()
    a = open_tier(mooncake_shared.master_address, prefix=prefix)
    b = open_tier(mooncake_shared.master_address, prefix=prefix)
    assert a.put(key(1), data(1), SEGMENT)
    assert b.contains(key(1)) and b.entry_bytes(key(1)) == ENTRY
    assert torch.equal(b.get(key(1), offset=100, length=5000), data(1)[100:5100])
    assert b.keys() == [] and b.used == 0  # the list and the budget are per process
    res = b.reserve(key(2), ENTRY, SEGMENT)  # Mooncake's put session: invisible, exclusive
    assert not a.contains(key(2))
    with pytest.raises(ValueError, match="being written"):
        a.put(key(2), data(2), SEGMENT)
    res.buffer.copy_(data(2))
    assert b.commit(res) and torch.equal(a.get(key(2)), data(2))
    assert b.delete(key(1)) and not a.contains(key(1))
    assert a.get(key(1)) is None and a.keys() == [] and a.used == 0  # a dropped what it lost
    a.close()
    b.close()


def test_oldest_is_the_head_of_this_processes_list_and_asks_the_master_nothing(mooncake_shared):
    """Mooncake lists objects in no order, so the tier's own list (chunks this process
    committed, oldest first) is what the uploader evicts from: its head, no master call."""
    with open_tier(mooncake_shared.master_address) as tier:
        for i in range(20):
            assert tier.put(key(i), data(i, 4096), 4096)
        calls = []
        call = tier._conn.call
        tier._conn.call = lambda *a, **kw: calls.append(a[0]) or call(*a, **kw)
        assert tier.oldest(3) == [key(0), key(1), key(2)] and calls == []


def test_another_process_learns_an_entry_size_from_its_header(mooncake_shared):
    prefix = unique_prefix()
    a = open_tier(mooncake_shared.master_address, prefix=prefix)
    b = open_tier(mooncake_shared.master_address, prefix=prefix)
    assert a.put(key(1), data(1), SEGMENT)  # a short header
    assert a.put(key(2), data(2, 1 << 20), 512)  # 2048 segments: a 16 KiB header, read in two steps
    assert header_len(2048) > 4096
    assert b.entry_bytes(key(1)) == ENTRY and b.entry_bytes(key(2)) == 1 << 20
    assert b.entry_bytes(key(3)) is None
    a.close()
    b.close()


def test_chunks_outlive_the_process_that_wrote_them(mooncake_shared):
    prefix = unique_prefix()
    with open_tier(mooncake_shared.master_address, prefix=prefix) as writer:
        for i in range(3):
            assert writer.put(key(i), data(i, 1 << 20), 1 << 18)
    with open_tier(mooncake_shared.master_address, prefix=prefix) as reader:
        for i in range(3):
            assert torch.equal(reader.get(key(i)), data(i, 1 << 20))


def test_corrupted_bytes_are_a_counted_miss_never_wrong_bytes(mooncake_shared, caplog):
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_shared.master_address) == 0
    with open_tier(mooncake_shared.master_address) as tier:
        for i in range(3):
            tier.put(key(i), data(i), SEGMENT)
        name = f"{tier.config.prefix}:{key(0).hex()}"
        obj = bytearray(raw.get(name))
        obj[header_len(4) + 2 * SEGMENT + 17] ^= 0xFF  # payload damage, segment 2
        assert raw.upsert(name, bytes(obj)) == 0
        assert torch.equal(tier.get(key(0), offset=0, length=SEGMENT), data(0)[:SEGMENT])
        assert tier.get(key(0)) is None
        assert "checksum mismatch in segment 2" in caplog.text
        assert tier.stats.corrupt == 1 and tier.stats.errors == 1
        assert not tier.contains(key(0)) and tier.keys() == [key(1), key(2)]
        name1 = f"{tier.config.prefix}:{key(1).hex()}"
        assert raw.upsert(name1, b"KVTR garbage") == 0  # garbled header
        assert tier.get(key(1)) is None and tier.stats.corrupt == 2
        assert torch.equal(tier.get(key(2)), data(2))  # nothing else lost
    raw.close()


def test_get_into_reads_straight_into_the_buffer_and_verifies_it(mooncake_shared, caplog):
    from mooncake.store import MooncakeDistributedStore

    prefix, big = unique_prefix(), 1 << 20
    writer = open_tier(mooncake_shared.master_address, prefix=prefix)
    reader = open_tier(mooncake_shared.master_address, prefix=prefix)  # knows no sizes
    for i in range(3):
        assert writer.put(key(i), data(i, big), SEGMENT)
    late = []
    for tier in (writer, reader):
        out = torch.zeros(big, dtype=torch.uint8)
        assert tier.get_into(key(1), out, late.append) and torch.equal(out, data(1, big))
    assert reader.stats.hits == 1 and reader.stats.bytes_read == big
    assert not reader.get_into(key(9), out, late.append) and reader.stats.misses == 1
    for tier in (writer, reader):  # a buffer of the wrong size is the caller's error
        with pytest.raises(ValueError, match="out must be"):
            tier.get_into(key(1), torch.zeros(big - 1, dtype=torch.uint8), late.append)
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_shared.master_address) == 0
    name = f"{prefix}:{key(2).hex()}"
    obj = bytearray(raw.get(name))
    obj[header_len(big // SEGMENT) + 7 * SEGMENT + 1] ^= 0x01  # one bit of segment 7
    assert raw.upsert(name, bytes(obj)) == 0
    outs = [torch.zeros(big, dtype=torch.uint8) for _ in range(3)]
    assert reader.get_many_into([key(0), key(2), key(1)], outs, late.append) == [True, False, True]
    assert torch.equal(outs[0], data(0, big)) and torch.equal(outs[2], data(1, big))
    assert reader.stats.corrupt == 1 and "checksum mismatch in segment 7" in caplog.text
    assert not writer.contains(key(2)) and late == []
    assert reader.get_into(key(0), out, late.append) and torch.equal(out, data(0, big))  # nothing else lost
    raw.close()
    writer.close()
    reader.close()


def _promotion_with_the_holder_stalled(servers):
    """A Mooncake tier (0.5 s timeout) holding chunks 1 and 2 below a DRAM tier, a mover between
    them, and the process holding Mooncake's memory stopped (SIGSTOP)."""
    from kvtier.core.mover import Shape
    from kvtier.store.moves import TierMover
    from kvtier.tiers.host import HostTier
    from kvtier.tiers.host_config import HostTierConfig

    servers.start()
    tier = open_tier(servers.master_address, timeout_s=0.5, reconnect_interval_s=0.2)
    host = HostTier(HostTierConfig(4 * ENTRY), ENTRY)
    mover = TierMover([host, tier], host, Shape(ENTRY, SEGMENT))
    assert tier.put_many([key(1), key(2)], [data(1), data(2)], SEGMENT) == [True, True]
    servers.holder.pause()
    return tier, host, mover


def test_a_read_given_up_on_keeps_its_buffer_until_it_ends(mooncake_private):
    """The holder of the bytes stalls mid-read: the read is a miss within the timeout, and the
    DRAM slot it was reading into stays reserved until the abandoned call has ended."""
    from kvtier.core.mover import Copied, Move

    tier, host, mover = _promotion_with_the_holder_stalled(mooncake_private)
    try:
        t0 = time.monotonic()
        assert mover.copy(Move(key(1), 1, 0)) is Copied.SOURCE_LOST
        assert time.monotonic() - t0 < 1.5 and tier.stats.errors >= 1
        assert host.used == ENTRY and not host.contains(key(1))  # the slot is held, not reused
    finally:
        mooncake_private.holder.resume()
    wait_until(lambda: host.used == 0, timeout_s=30)  # released once the call ended
    assert wait_until(lambda: mover.copy(Move(key(1), 1, 0)) is Copied.OK, timeout_s=30)
    assert torch.equal(host.get(key(1)), data(1))
    host.close()
    tier.close()


def test_a_batched_read_given_up_on_keeps_all_its_buffers_until_it_ends(mooncake_private):
    from kvtier.core.mover import Copied, Move

    tier, host, mover = _promotion_with_the_holder_stalled(mooncake_private)
    try:
        t0 = time.monotonic()
        assert mover.copy_many([Move(key(1), 1, 0), Move(key(2), 1, 0)]) == [Copied.SOURCE_LOST] * 2
        assert time.monotonic() - t0 < 1.5 and tier.stats.errors >= 1
        assert host.used == 2 * ENTRY and len(host) == 0  # both slots held, not reused
    finally:
        mooncake_private.holder.resume()
    wait_until(lambda: host.used == 0, timeout_s=30)  # released once the call ended
    assert wait_until(lambda: mover.copy_many([Move(key(1), 1, 0), Move(key(2), 1, 0)]) == [Copied.OK] * 2, timeout_s=30)
    assert torch.equal(host.get(key(1)), data(1)) and torch.equal(host.get(key(2)), data(2))
    host.close()
    tier.close()


def test_closing_waits_for_a_read_given_up_on(mooncake_private):
    """A read abandoned at its timeout still runs: closing the tier waits for it to end before
    the client (and, in a store, the DRAM arena it writes into) goes away."""
    import threading

    from kvtier.core.mover import Move

    tier, host, mover = _promotion_with_the_holder_stalled(mooncake_private)
    try:
        mover.copy(Move(key(1), 1, 0))
        assert host.used == ENTRY
        threading.Timer(1.0, mooncake_private.holder.resume).start()
        t0 = time.monotonic()
        tier.close()  # waits for the abandoned read (about 1 s), then closes the client
        assert time.monotonic() - t0 > 0.5 and host.used == 0
    finally:
        mooncake_private.holder.resume()
    host.close()


def test_master_down_at_start_then_up(mooncake_private):
    t0 = time.monotonic()
    tier = open_tier(mooncake_private.master_address, timeout_s=0.5, reconnect_interval_s=0.2)
    assert time.monotonic() - t0 < 1.5  # construction does not wait for the master
    assert tier.get(key(1)) is None and not tier.contains(key(1))
    with pytest.raises(TierFullError, match="unavailable"):
        tier.put(key(1), data(1), SEGMENT)
    assert tier.stats.misses == 1 and tier.stats.errors >= 1
    mooncake_private.start()
    wait_until(lambda: try_put(tier, 1), timeout_s=30)
    assert torch.equal(tier.get(key(1)), data(1))
    tier.close()


def test_master_killed_mid_run_then_restarted(mooncake_private):
    mooncake_private.start()
    tier = open_tier(mooncake_private.master_address, timeout_s=0.5, reconnect_interval_s=0.2)
    assert tier.put(key(1), data(1), SEGMENT)
    mooncake_private.master.kill()
    t0 = time.monotonic()
    assert tier.get(key(1)) is None
    assert time.monotonic() - t0 < 1.5 and tier.stats.errors >= 1
    mooncake_private.master.start()  # same port; the objects it knew are gone
    wait_until(lambda: try_put(tier, 2), timeout_s=30)
    assert torch.equal(tier.get(key(2)), data(2))
    assert tier.get(key(1)) is None and tier.keys() == [key(2)]
    tier.close()


def test_an_outage_does_not_make_the_uploader_drop_chunks_it_listed(mooncake_private):
    """A put refused because the master is down is not a full tier: the uploader evicts
    nothing, and a remove that cannot reach the master leaves the chunk listed."""
    from kvtier.store.uploader import Uploader
    from kvtier.tiers.base import TierUnavailableError

    mooncake_private.start()
    tier = open_tier(mooncake_private.master_address, timeout_s=0.5, reconnect_interval_s=0.2)
    assert tier.put_many([key(i) for i in range(3)], [data(i) for i in range(3)], SEGMENT) == [True] * 3
    used = tier.used
    mooncake_private.master.kill()
    uploader = Uploader(tier, SEGMENT, max_queued=4)
    try:
        outcomes = []
        assert uploader.submit(key(9), data(9), outcomes.append)
        assert uploader.flush(timeout=10) and outcomes == [False]
        assert uploader.stats.evicted == 0 and uploader.stats.failed == 1
        assert not tier.delete(key(0))
        assert tier.keys() == [key(i) for i in range(3)] and tier.used == used
        with pytest.raises(TierUnavailableError):
            tier.put(key(9), data(9), SEGMENT)
    finally:
        uploader.close()
        tier.close()


def test_a_stalled_master_times_out_then_recovers(mooncake_private):
    mooncake_private.start()
    prefix = unique_prefix()
    tier = open_tier(mooncake_private.master_address, prefix=prefix, timeout_s=0.5, reconnect_interval_s=0.2)
    reader = open_tier(mooncake_private.master_address, prefix=prefix, timeout_s=0.5, reconnect_interval_s=0.2)
    assert tier.put(key(1), data(1), SEGMENT)
    mooncake_private.master.pause()
    try:
        t0 = time.monotonic()
        assert reader.get(key(1)) is None  # it must ask the master where the chunk is
        assert not reader.contains(key(1))  # down: fails fast, no second wait
        assert time.monotonic() - t0 < 1.2 and reader.stats.errors >= 1
        assert not tier.contains(key(1)) and tier.stats.errors >= 1
    finally:
        mooncake_private.master.resume()
    assert torch.equal(wait_until(lambda: reader.get(key(1)), timeout_s=30), data(1))
    reader.close()
    tier.close()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"master_address": "nohost"}, "master_address"),
        ({"capacity_bytes": -1}, "capacity_bytes"),
        ({"protocol": "udp"}, "protocol"),
        ({"metadata_server": ""}, "metadata_server"),
        ({"global_segment_bytes": -5}, "global_segment_bytes"),
        ({"prefix": "a b"}, "prefix"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"workers": 0}, "workers"),
    ],
)
def test_an_invalid_config_raises_naming_the_field(kwargs, field):
    base = {"master_address": "127.0.0.1:50051", "capacity_bytes": 1 << 20}
    with pytest.raises(ValueError, match=field):
        MooncakeTierConfig(**{**base, **kwargs})
