"""The contract every tier passes (cachetools' CacheTestMixin pattern).

A test module subclasses :class:`TierContract` and provides ``make_tier(capacity_entries)``,
returning a tier that holds at least ``capacity_entries`` entries of ``ENTRY`` bytes and not
more than ``capacity_entries``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.tiers.base import EntryExistsError, EntryPinnedError, Tier, TierFullError

ENTRY = 16384
SEGMENT = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data(i: int, n: int = ENTRY) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def try_put(tier: Tier, i: int) -> bool:
    """Put entry ``i``; False while the tier refuses (a remote tier whose server is down)."""
    try:
        return tier.put(key(i), data(i), SEGMENT)
    except TierFullError:
        return False


class TierContract:
    def make_tier(self, capacity_entries: int) -> Tier:
        raise NotImplementedError

    @pytest.fixture
    def tier(self):
        t = self.make_tier(4)
        yield t
        t.close()

    def test_put_then_get_returns_the_same_bytes(self, tier):
        assert tier.put(key(1), data(1), SEGMENT)
        assert tier.contains(key(1))
        assert tier.entry_bytes(key(1)) == ENTRY
        assert torch.equal(tier.get(key(1)), data(1))
        assert tier.keys() == [key(1)]
        assert tier.used >= ENTRY and tier.used <= tier.capacity
        assert tier.stats.writes == 1 and tier.stats.hits == 1

    def test_get_a_range_into_a_buffer(self, tier):
        tier.put(key(1), data(1), SEGMENT)
        out = torch.empty(SEGMENT + 100, dtype=torch.uint8)
        assert tier.get(key(1), out=out, offset=SEGMENT - 50, length=SEGMENT + 100) is out
        assert torch.equal(out, data(1)[SEGMENT - 50 : 2 * SEGMENT + 50])
        seg2 = tier.get(key(1), offset=2 * SEGMENT, length=SEGMENT)
        assert torch.equal(seg2, data(1)[2 * SEGMENT : 3 * SEGMENT])
        with pytest.raises(ValueError, match="outside"):
            tier.get(key(1), offset=ENTRY - 10, length=20)

    def test_a_miss_is_none_and_counted(self, tier):
        assert tier.get(key(7)) is None
        assert not tier.contains(key(7)) and tier.entry_bytes(key(7)) is None
        assert tier.stats.misses == 1

    def test_contains_prefix_counts_the_leading_entries_held(self, tier):
        for i in (0, 1, 3):
            assert tier.put(key(i), data(i), SEGMENT)
        assert tier.contains_prefix([key(0), key(1), key(2), key(3)]) == 2
        assert tier.contains_prefix([key(0), key(1)]) == 2
        assert tier.contains_prefix([key(2), key(3)]) == 0
        assert tier.contains_prefix([]) == 0
        res = tier.reserve(key(2), ENTRY, SEGMENT)  # being written: not held yet
        assert tier.contains_prefix([key(0), key(1), key(2), key(3)]) == 2
        res.buffer.copy_(data(2))
        assert tier.commit(res)
        assert tier.contains_prefix([key(0), key(1), key(2), key(3)]) == 4

    def test_an_entry_being_written_is_invisible_until_committed(self, tier):
        res = tier.reserve(key(1), ENTRY, SEGMENT)
        res.buffer.copy_(data(1))
        assert not tier.contains(key(1)) and tier.get(key(1)) is None
        assert key(1) not in tier.keys()
        assert tier.used > 0  # the space is taken
        with pytest.raises(ValueError, match="already stored or being written"):
            tier.reserve(key(1), ENTRY)
        assert tier.commit(res)
        assert torch.equal(tier.get(key(1)), data(1))

    def test_an_abandoned_write_leaves_nothing_behind(self, tier):
        res = tier.reserve(key(1), ENTRY, SEGMENT)
        res.buffer.fill_(7)
        assert tier.commit(res, ok=False) is False
        assert not tier.contains(key(1)) and tier.used == 0 and tier.keys() == []
        assert tier.put(key(1), data(1))  # the key is free again

    def test_unusable_data_raises_and_leaves_nothing_behind(self, tier):
        with pytest.raises(ValueError, match="contiguous"):
            tier.put(key(2), data(2).view(128, 128).t(), SEGMENT)
        assert not tier.contains(key(2)) and tier.used == 0

    def test_storing_a_key_twice_is_refused_and_keeps_the_first(self, tier):
        tier.put(key(1), data(1))
        with pytest.raises(ValueError, match="already"):
            tier.put(key(1), data(2))
        assert torch.equal(tier.get(key(1)), data(1))

    def test_put_many_stores_each_and_reports_each_outcome(self, tier):
        assert tier.put(key(1), data(1), SEGMENT)
        got = tier.put_many([key(0), key(1), key(2)], [data(0), data(9), data(2)], SEGMENT)
        assert got[0] is True and got[2] is True
        assert isinstance(got[1], EntryExistsError) and "already" in str(got[1])
        for i in range(3):
            assert torch.equal(tier.get(key(i)), data(i))  # the refused entry kept the first bytes
        assert tier.put_many([], [], SEGMENT) == []
        more = tier.put_many([key(i) for i in range(3, 12)], [data(i) for i in range(3, 12)], SEGMENT)
        assert True in more and any(isinstance(r, TierFullError) for r in more)  # past capacity
        assert tier.used <= tier.capacity
        assert tier.keys()[:3] == [key(1), key(0), key(2)]

    def test_put_many_with_bad_arguments_writes_nothing(self, tier):
        with pytest.raises(ValueError, match="keys"):
            tier.put_many([key(1), key(2)], [data(1)], SEGMENT)
        with pytest.raises(ValueError):
            tier.put_many([key(1), key(2)], [data(1), data(2, tier.capacity + 1)], SEGMENT)
        with pytest.raises(TypeError):
            tier.put_many([key(1), b"short"], [data(1), data(2)], SEGMENT)
        assert tier.keys() == [] and tier.used == 0

    def test_get_many_into_reads_each_and_misses_what_is_absent(self, tier):
        assert tier.put_many([key(0), key(2)], [data(0), data(2)], SEGMENT) == [True, True]
        outs = [torch.zeros(ENTRY, dtype=torch.uint8) for _ in range(3)]
        late: list = []
        assert tier.get_many_into([key(0), key(1), key(2)], outs, late.append) == [True, False, True]
        assert torch.equal(outs[0], data(0)) and torch.equal(outs[2], data(2)) and not late
        assert tier.stats.hits == 2 and tier.stats.misses == 1
        odd = torch.zeros(2 * ENTRY, dtype=torch.uint8)[::2]  # not contiguous: read another way
        assert tier.get_many_into([key(2), key(0)], [odd, outs[1]], late.append) == [True, True]
        assert torch.equal(odd, data(2)) and torch.equal(outs[1], data(0))
        assert tier.get_many_into([], [], late.append) == []
        with pytest.raises(ValueError):
            tier.get_many_into([key(0)], [], late.append)

    def test_full_tier_refuses_and_delete_frees_room(self, tier):
        n = 0
        while True:
            try:
                tier.put(key(n), data(n), SEGMENT)
            except TierFullError:
                break
            n += 1
        assert n >= 4
        assert tier.used <= tier.capacity
        assert len(tier) == n
        assert tier.delete(key(0)) and not tier.contains(key(0))
        assert tier.delete(key(0)) is False
        assert tier.put(key(100), data(100), SEGMENT)
        for i in range(1, n):
            assert torch.equal(tier.get(key(i)), data(i))  # nothing else was lost

    def test_a_pinned_entry_cannot_be_deleted(self, tier):
        tier.put(key(1), data(1))
        assert tier.pin(key(1)) and tier.pin(key(1))  # pins nest
        with pytest.raises(EntryPinnedError, match="pinned"):
            tier.delete(key(1))
        tier.unpin(key(1))
        with pytest.raises(EntryPinnedError):
            tier.delete(key(1))
        tier.unpin(key(1))
        assert not tier.is_pinned(key(1))
        assert tier.delete(key(1))

    def test_pins_count_entries_and_every_nested_pin(self, tier):
        tier.put(key(1), data(1))
        tier.put(key(2), data(2))
        assert tier.pin(key(1)) and tier.pin(key(1)) and tier.pin(key(2))
        assert (tier.pinned_count(), tier.pin_total()) == (2, 3)
        tier.unpin(key(1))
        assert (tier.pinned_count(), tier.pin_total()) == (2, 2)
        tier.unpin(key(1))
        tier.unpin(key(2))
        assert (tier.pinned_count(), tier.pin_total()) == (0, 0)

    def test_oldest_is_the_head_of_keys_oldest_first(self, tier):
        for i in (3, 1, 2):
            assert tier.put(key(i), data(i), SEGMENT)
        assert tier.oldest(2) == tier.keys()[:2] == [key(3), key(1)]
        assert tier.oldest(10) == tier.keys() == [key(3), key(1), key(2)]
        assert tier.oldest(0) == []
        tier.delete(key(3))
        assert tier.oldest(1) == [key(1)]
        with pytest.raises(ValueError, match="oldest"):
            tier.oldest(-1)

    def test_pinning_something_absent_pins_nothing(self, tier):
        assert tier.pin(key(5)) is False
        with tier.pinned(key(5)) as held:
            assert held is False
        with pytest.raises(ValueError, match="not pinned"):
            tier.unpin(key(5))

    def test_bad_arguments_raise_and_change_nothing(self, tier):
        tier.put(key(1), data(1))
        with pytest.raises(ValueError, match="positive"):
            tier.reserve(key(2), 0)
        with pytest.raises(ValueError, match="larger than"):
            tier.reserve(key(2), tier.capacity + 1)
        with pytest.raises(TypeError, match="16 bytes"):
            tier.reserve(b"short", ENTRY)
        with pytest.raises(TypeError, match="16 bytes"):
            tier.reserve("0123456789abcdef", ENTRY)  # type: ignore[arg-type]
        assert tier.keys() == [key(1)] and torch.equal(tier.get(key(1)), data(1))

    def test_concurrent_writers_and_readers(self, tier):
        errors: list[BaseException] = []

        def work(worker: int) -> None:
            try:
                for round_ in range(20):
                    k = key(1000 * worker + round_)
                    while True:
                        try:
                            tier.put(k, data(worker), SEGMENT)
                            break
                        except TierFullError:
                            pass
                    assert torch.equal(tier.get(k), data(worker))
                    assert tier.delete(k)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert tier.used == 0 and tier.keys() == []
