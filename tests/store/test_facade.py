"""The store, told as stories: save, look up, load, demote, promote, restart, damage."""

import os

import pytest
import torch

from kvtier import DiskTierConfig, HostTierConfig, KVStore, StoreConfig
from kvtier.core.layout import KVLayout
from kvtier.core.policy import POLICIES, LRUPolicy
from kvtier.tiers.disk_format import header_len_for

from ..conftest import make_kv

C = 16  # chunk tokens in the `layout` fixture


def store_of(layout: KVLayout, host_chunks: int, disk_path=None, disk_chunks: int = 64, **kw) -> KVStore:
    disk = None
    if disk_path is not None:
        per = header_len_for(layout.num_layers) + layout.chunk_bytes
        disk = DiskTierConfig(str(disk_path), disk_chunks * per)
    return KVStore(
        StoreConfig(model="tiny@1", layout=layout, host=HostTierConfig(host_chunks * layout.chunk_bytes), disk=disk, **kw)
    )


def assert_kv_equal(loaded, kv, tokens: int) -> None:
    assert len(loaded) == len(kv)
    for got, want in zip(loaded, kv):
        for g, w in zip(got, want):
            assert g.shape[1] == tokens
            assert torch.equal(g, w[:, :tokens])


def test_store_four_chunks_and_load_them_back_exactly(layout):
    tokens = list(range(4 * C + 5))  # the 5-token tail is never cached
    kv = make_kv(layout, len(tokens))
    with store_of(layout, host_chunks=8) as store:
        assert store.lookup(tokens).hit_tokens == 0
        saved = store.save(tokens, kv)
        assert (saved.stored, saved.present, saved.dropped) == (4, 0, 0)
        hit = store.lookup(tokens)
        assert hit.hit_tokens == 4 * C and hit.tiers == ["host"] * 4
        assert hit.tier_tokens == {"host": 4 * C}
        loaded = store.load(hit)
        assert loaded.tokens == 4 * C and loaded.tiers == ["host"] * 4
        assert_kv_equal(loaded.kv, kv, 4 * C)
        snap = store.snapshot()
        assert snap["tiers"]["host"]["chunks"] == 4 and snap["tiers"]["host"]["hits"] == 4


def test_a_longer_conversation_hits_its_history_and_saves_only_new_chunks(layout):
    turn1 = list(range(2 * C + 3))
    turn2 = turn1 + list(range(500, 500 + 2 * C))
    kv2 = make_kv(layout, len(turn2), seed=1)
    with store_of(layout, host_chunks=8) as store:
        store.save(turn1, [tuple(t[:, : len(turn1)] for t in pair) for pair in kv2])
        hit = store.lookup(turn2)
        assert hit.hit_tokens == 2 * C
        saved = store.save(turn2, kv2)
        assert (saved.stored, saved.present) == (2, 2)
        assert store.lookup(turn2).hit_tokens == 4 * C


def test_a_shared_prefix_from_another_user_is_stored_once(layout):
    system = list(range(3 * C))
    alice, bob = system + [1] * C, system + [2] * C
    with store_of(layout, host_chunks=16) as store:
        store.save(alice, make_kv(layout, len(alice)))
        assert store.save(bob, make_kv(layout, len(bob))) .present == 3
        assert store.snapshot()["tiers"]["host"]["chunks"] == 5
        assert store.lookup(bob).hit_tokens == 4 * C


def test_tenants_never_hit_each_others_chunks(layout):
    tokens = list(range(2 * C))
    with store_of(layout, host_chunks=8) as store:
        store.save(tokens, make_kv(layout, len(tokens)), tenant="acme")
        assert store.lookup(tokens, tenant="acme").hit_tokens == 2 * C
        assert store.lookup(tokens, tenant="globex").hit_tokens == 0
        assert store.lookup(tokens).hit_tokens == 0


def test_a_full_host_tier_demotes_to_ssd_and_a_hit_on_ssd_promotes(layout, tmp_path):
    a, b = list(range(3 * C)), list(range(1000, 1000 + 3 * C))
    kva, kvb = make_kv(layout, 3 * C, seed=1), make_kv(layout, 3 * C, seed=2)
    with store_of(layout, host_chunks=3, disk_path=tmp_path) as store:
        store.save(a, kva)
        store.save(b, kvb)  # pushes a's chunks down to SSD
        hit = store.lookup(a)
        assert hit.hit_tokens == 3 * C and hit.tiers == ["disk"] * 3
        loaded = store.load(hit)
        assert loaded.tiers == ["host"] * 3  # promoted into DRAM, then served
        assert_kv_equal(loaded.kv, kva, 3 * C)
        assert store.lookup(a).tiers == ["host"] * 3
        hit_b = store.lookup(b)
        assert hit_b.tiers == ["disk"] * 3  # b went down to make room
        assert_kv_equal(store.load(hit_b).kv, kvb, 3 * C)
        snap = store.snapshot()
        assert snap["demotions"] >= 6 and snap["promotions"] == 6
        assert snap["tiers"]["disk"]["hits"] == 6


def test_without_ssd_lru_drops_a_conversations_later_chunks_first(layout):
    a, b = list(range(4 * C)), list(range(1000, 1000 + 2 * C))
    with store_of(layout, host_chunks=4) as store:
        store.save(a, make_kv(layout, 4 * C))
        store.save(b, make_kv(layout, 2 * C))
        # a's last two chunks went; its first two, which still make a valid prefix, stayed
        assert store.lookup(a).hit_tokens == 2 * C
        assert store.lookup(b).hit_tokens == 2 * C
        assert store.snapshot()["tiers"]["host"]["evictions"] == 2


def test_chunks_saved_to_ssd_survive_a_restart(layout, tmp_path):
    tokens = list(range(5 * C))
    kv = make_kv(layout, len(tokens), seed=3)
    with store_of(layout, host_chunks=2, disk_path=tmp_path) as store:
        store.save(tokens, kv)  # 3 of 5 chunks demoted
        store.save(list(range(7000, 7000 + 2 * C)), make_kv(layout, 2 * C))  # and the other 2
    with store_of(layout, host_chunks=2, disk_path=tmp_path) as store:
        hit = store.lookup(tokens)
        assert hit.hit_tokens == 5 * C and set(hit.tiers) == {"disk"}
        assert_kv_equal(store.load(hit).kv, kv, 5 * C)


def test_a_corrupted_chunk_ends_the_prefix_and_never_returns_wrong_bytes(layout, tmp_path):
    tokens = list(range(4 * C))
    kv = make_kv(layout, len(tokens), seed=4)
    with store_of(layout, host_chunks=1, disk_path=tmp_path) as store:
        store.save(tokens, kv)
        store.save(list(range(9000, 9000 + C)), make_kv(layout, C))  # everything of `tokens` on SSD
        hit = store.lookup(tokens)
        assert hit.tiers == ["disk"] * 4
        path = store.tiers[1]._path(hit.keys[2])
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 10)
            f.write(b"\x00garbage\x00")
        loaded = store.load(hit)
        assert loaded.tokens == 2 * C  # chunks 0 and 1 only
        assert_kv_equal(loaded.kv, kv, 2 * C)
        snap = store.snapshot()
        assert snap["load_failures"] == 1 and snap["tiers"]["disk"]["io"]["corrupt"] == 1
        assert store.lookup(tokens).hit_tokens == 2 * C  # the damaged chunk is gone from the index


def test_load_into_caller_buffers_and_single_layers(layout):
    tokens = list(range(2 * C))
    kv = make_kv(layout, len(tokens))
    with store_of(layout, host_chunks=4) as store:
        store.save(tokens, kv)
        hit = store.lookup(tokens)
        out = [tuple(torch.full((layout.num_kv_heads, 3 * C, layout.head_dim), -1.0) for _ in range(2))
               for _ in range(layout.num_layers)]
        loaded = store.load(hit, out=out, layers=[2])
        assert torch.equal(out[2][0][:, : 2 * C], kv[2][0]) and torch.equal(out[2][1][:, : 2 * C], kv[2][1])
        assert (out[0][0] == -1).all() and (out[2][0][:, 2 * C :] == -1).all()
        assert loaded.kv[2][0].data_ptr() == out[2][0].data_ptr()
        with pytest.raises(IndexError, match="layer 9"):
            store.load(hit, layers=[9])
        short = [tuple(t[:, :C] for t in pair) for pair in out]
        with pytest.raises(ValueError, match="out holds 16 tokens"):
            store.load(hit, out=short)


def test_bad_kv_and_tokens_raise_and_nothing_stored_is_lost(layout):
    tokens = list(range(2 * C))
    kv = make_kv(layout, len(tokens))
    with store_of(layout, host_chunks=8) as store:
        store.save(tokens, kv)
        other = list(range(100, 100 + 2 * C))
        bad_cases = [
            (kv[:-1], ValueError, "3 layers, layout has 4"),
            ([(k.double(), v.double()) for k, v in kv], TypeError, "dtype torch.float64"),
            ([(k[:1], v[:1]) for k, v in kv], ValueError, "expected \\[2, tokens, 32\\]"),
            ([(k,) for k, _ in kv], ValueError, "must hold 2 tensors"),
            ([(k, v[:, :C]) for k, v in kv], ValueError, "tokens, earlier layers"),
            (torch.zeros(3), TypeError, "one \\(K, V\\) pair per layer"),
        ]
        for bad, exc, words in bad_cases:
            with pytest.raises(exc, match=words):
                store.save(other, bad)
        with pytest.raises(TypeError, match="integers"):
            store.save([0.5] * (2 * C), make_kv(layout, 2 * C))
        with pytest.raises(ValueError, match="covers 32 tokens but only 16"):
            store.save(tokens[:C], kv)
        assert store.lookup(other).hit_tokens == 0
        assert_kv_equal(store.load(store.lookup(tokens)).kv, kv, 2 * C)


def test_a_batch_dimension_of_one_is_accepted(layout):
    tokens = list(range(C))
    kv = make_kv(layout, C)
    with store_of(layout, host_chunks=2) as store:
        assert store.save(tokens, [(k[None], v[None]) for k, v in kv]).stored == 1
        assert_kv_equal(store.load(store.lookup(tokens)).kv, kv, C)


def test_bad_store_config_raises(layout, tmp_path):
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        StoreConfig(model="m", layout=layout, host=HostTierConfig(1 << 20), policy="mru")
    with pytest.raises(ValueError, match="model"):
        StoreConfig(model="", layout=layout, host=HostTierConfig(1 << 20))
    with pytest.raises(ValueError, match="offline bound"):
        StoreConfig(model="m", layout=layout, host=HostTierConfig(1 << 20), policy="optimal")
    with pytest.raises(ValueError, match="smaller than one chunk slot"):
        KVStore(StoreConfig(model="m", layout=layout, host=HostTierConfig(layout.chunk_bytes - 1)))
    with pytest.raises(ValueError, match="disk capacity of 4096 bytes cannot hold one chunk"):
        KVStore(StoreConfig(model="m", layout=layout, host=HostTierConfig(layout.chunk_bytes),
                            disk=DiskTierConfig(str(tmp_path), 4096)))
    KVStore(StoreConfig(model="m", layout=layout, host=HostTierConfig(layout.chunk_bytes),
                        disk=DiskTierConfig(str(tmp_path), 1 << 20))).close()  # the directory was released


def test_a_pinned_chunk_is_not_evicted(layout):
    a, b = list(range(C)), list(range(500, 500 + C))
    with store_of(layout, host_chunks=1) as store:
        store.save(a, make_kv(layout, C))
        key = store.lookup(a).keys[0]
        with store.host.pinned(key):
            saved = store.save(b, make_kv(layout, C))
            assert saved.dropped == 1 and saved.stored == 0
        assert store.lookup(a).hit_tokens == C
        assert store.save(b, make_kv(layout, C)).stored == 1  # once unpinned, LRU makes room


def test_write_through_puts_every_saved_chunk_on_ssd_at_once(layout, tmp_path):
    tokens = list(range(3 * C))
    kv = make_kv(layout, len(tokens), seed=5)
    per = header_len_for(layout.num_layers) + layout.chunk_bytes
    config = StoreConfig(model="tiny@1", layout=layout, host=HostTierConfig(8 * layout.chunk_bytes),
                         disk=DiskTierConfig(str(tmp_path), 16 * per), write_through=True)
    with KVStore(config) as store:
        store.save(tokens, kv)
        assert store.lookup(tokens).tiers == ["host"] * 3
        assert store.snapshot()["tiers"]["disk"]["chunks"] == 3
    with KVStore(config) as store:  # DRAM is gone after a restart; SSD still has everything
        hit = store.lookup(tokens)
        assert hit.tiers == ["disk"] * 3
        assert_kv_equal(store.load(hit).kv, kv, 3 * C)


@pytest.mark.parametrize("policy", ["lru", "fifo", "attentionstore", "cost", "returns"])
def test_every_live_policy_runs_the_store_story(layout, tmp_path, policy):
    a, b = list(range(3 * C)), list(range(1000, 1000 + 3 * C))
    kva, kvb = make_kv(layout, 3 * C, seed=1), make_kv(layout, 3 * C, seed=2)
    with store_of(layout, host_chunks=3, disk_path=tmp_path, policy=policy) as store:
        store.save(a, kva)
        store.save(b, kvb)
        for tokens, kv in ((a, kva), (b, kvb)):
            hit = store.lookup(tokens)
            loaded = store.load(hit)
            assert loaded.tokens == hit.hit_tokens
            assert_kv_equal(loaded.kv, kv, loaded.tokens)
        assert store.snapshot()["tiers"]["host"]["used_bytes"] <= 3 * layout.chunk_bytes


class _RefuseDeepChunks(LRUPolicy):
    """A policy that admits only the first two chunks of a sequence into DRAM and nothing
    into SSD (admission is the policy's call; the store must obey it)."""

    def admit(self, key, position):
        return position is not None and position < 2


def test_the_store_obeys_the_policys_admission(layout, tmp_path, monkeypatch):
    import kvtier.store.config as store_module

    monkeypatch.setitem(POLICIES, "refuse-deep", lambda context: _RefuseDeepChunks())
    monkeypatch.setattr(store_module, "LIVE_POLICIES", (*store_module.LIVE_POLICIES, "refuse-deep"))
    tokens = list(range(4 * C))
    with store_of(layout, host_chunks=2, disk_path=tmp_path, policy="refuse-deep") as store:
        saved = store.save(tokens, make_kv(layout, 4 * C))
        assert (saved.stored, saved.dropped) == (2, 2)  # chunks 2 and 3 refused
        store.save(list(range(900, 900 + 2 * C)), make_kv(layout, 2 * C))  # evicts the first two
        snap = store.snapshot()
        assert snap["demotions"] == 0 and snap["tiers"]["disk"]["chunks"] == 0  # SSD refused them
        assert store.lookup(tokens).hit_tokens == 0


@pytest.mark.parametrize("policy, a_stays", [("lru", False), ("attentionstore", True), ("cost", True)])
def test_a_queued_request_keeps_its_chunks_in_dram_under_a_look_ahead_policy(layout, tmp_path, policy, a_stays):
    # DRAM holds 4 chunks: conversations A and B. A request for A is queued (not yet served);
    # B is used after that, so A is the least recently used. Saving C needs room for 2 chunks:
    # LRU demotes A to SSD, a look-ahead policy demotes B, which no queued request needs.
    a, b, c = (list(range(s, s + 2 * C)) for s in (0, 1000, 2000))
    with store_of(layout, host_chunks=4, disk_path=tmp_path, policy=policy) as store:
        store.save(a, make_kv(layout, 2 * C, seed=1))
        store.save(b, make_kv(layout, 2 * C, seed=2))
        keys_a = store.lookup(a).keys
        assert store.queued("req-a", keys_a) == 0  # already in DRAM: nothing to promote
        store.load(store.lookup(b))
        store.save(c, make_kv(layout, 2 * C, seed=3))
        store.started("req-a")
        hit = store.lookup(a)
        assert hit.hit_tokens == 2 * C
        assert (hit.tiers == ["host"] * 2) is a_stays
        assert (store.lookup(b).tiers == ["host"] * 2) is not a_stays


def test_a_queued_request_has_its_chunks_prefetched_from_ssd(layout, tmp_path):
    a, b = list(range(2 * C)), list(range(1000, 1000 + 2 * C))
    with store_of(layout, host_chunks=2, disk_path=tmp_path) as store:
        store.save(a, make_kv(layout, 2 * C, seed=1))
        store.save(b, make_kv(layout, 2 * C, seed=2))  # A goes down to SSD
        assert store.lookup(a).tiers == ["disk"] * 2
        assert store.queued("req-a", store.lookup(a).keys) == 2
        store.started("req-a")
        store.started("never-queued")  # ignored
        assert store.lookup(a).tiers == ["host"] * 2
        assert store.snapshot()["promotions"] == 2
