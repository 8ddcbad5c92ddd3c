import pytest

from kvtier.core.policy import POLICIES, LRUPolicy, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_registry_builds_policies_by_name_and_names_the_known_ones():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert "lru" in POLICIES
    with pytest.raises(ValueError, match="known policies: \\['lru'"):
        make_policy("mru")


def test_lru_evicts_least_recent_first():
    p = LRUPolicy()
    for i in range(3):
        p.insert(k(i))
    p.touch([k(0)])
    assert p.victim(lambda key: True) == k(1)


def test_a_conversation_loses_its_later_chunks_before_its_earlier_ones():
    p = LRUPolicy()
    convo = [k(i) for i in range(4)]
    for key in convo:
        p.insert(key)
    p.touch(convo)
    order = []
    while (v := p.victim(lambda key: True)) is not None:
        order.append(v)
        p.remove(v)
    assert order == [k(3), k(2), k(1), k(0)]


def test_victim_skips_what_the_store_cannot_evict():
    p = LRUPolicy()
    for i in range(3):
        p.insert(k(i))
    assert p.victim(lambda key: key != k(0)) == k(1)
    assert p.victim(lambda key: False) is None
    p.remove(k(1))
    p.remove(k(99))  # absent: no error
    assert len(p) == 2
