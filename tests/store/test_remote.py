"""Stores on two "machines" sharing one remote tier, told as stories: write-through and
write-back, cross-instance hits, one copy of a shared prefix, tenants, and the remote server
down, killed, stalled or corrupting bytes. Real servers (Valkey, Mooncake) on loopback."""

import time

import pytest
import torch

from kvtier import HostTierConfig, KVStore, StoreConfig
from kvtier.store import RemoteConfig
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.disk_format import header_len_for
from kvtier.tiers.mooncake import MooncakeTierConfig
from kvtier.tiers.valkey import ValkeyTierConfig
from tests.remote_servers import unique_prefix, wait_until

from ..conftest import make_kv

C = 16


def valkey_remote(address: str, prefix: str, write: str = "through", **kw) -> RemoteConfig:
    kw.setdefault("timeout_s", 0.5)
    kw.setdefault("reconnect_interval_s", 0.2)
    return RemoteConfig(ValkeyTierConfig((address,), 64 << 20, prefix=prefix, **kw), write=write)


def store_on(layout, remote: RemoteConfig, host_chunks: int = 8, disk_path=None, **kw) -> KVStore:
    disk = None
    if disk_path is not None:
        disk = DiskTierConfig(str(disk_path), 16 * (header_len_for(layout.num_layers) + layout.chunk_bytes))
    return KVStore(StoreConfig(model="tiny@1", layout=layout, disk=disk, remote=remote,
                               host=HostTierConfig(host_chunks * layout.chunk_bytes), **kw))


def assert_same(loaded, kv, tokens):
    for got, want in zip(loaded.kv, kv):
        for g, w in zip(got, want):
            assert torch.equal(g[:, :tokens], w[:, :tokens])


@pytest.fixture(params=["valkey", "mooncake"])
def remote(request, tmp_path):
    """A fresh namespace on a shared server of each backend: a factory of RemoteConfigs."""
    prefix = unique_prefix()
    if request.param == "valkey":
        server = request.getfixturevalue("valkey_standalone")
        return lambda write="through": valkey_remote(server.address, prefix, write)
    servers = request.getfixturevalue("mooncake_shared")
    return lambda write="through": RemoteConfig(
        MooncakeTierConfig(servers.master_address, 64 << 20, prefix=prefix), write=write)


def counting(tier, method: str) -> list[int]:
    """Count calls of ``tier.method`` (a wrapper around the real method: nothing is faked).
    Returns the list of batch sizes it was called with."""
    sizes: list[int] = []
    real = getattr(tier, method)

    def wrapper(keys, *args, **kw):
        sizes.append(len(keys))
        return real(keys, *args, **kw)

    setattr(tier, method, wrapper)
    return sizes


def test_turn_one_on_machine_a_turn_two_on_machine_b_hits_the_remote_tier(layout, tmp_path, remote):
    """Turn 1 through store A, turn 2 through store B: B's hit is in the remote tier, moved in
    batches (B's three promotions in one get_many_into)."""
    turn1 = list(range(3 * C))
    kv = make_kv(layout, 3 * C, seed=5)
    with store_on(layout, remote(), disk_path=tmp_path / "a") as a:
        puts = counting(a.remote, "put_many")
        assert a.save(turn1, kv).stored == 3
        assert a.flush(timeout=10)
        assert a.snapshot()["uploads"]["uploaded"] == 3 and sum(puts) == 3
    turn2 = turn1 + list(range(900, 900 + C))
    with store_on(layout, remote(), disk_path=tmp_path / "b") as b:
        hit = b.lookup(turn2)
        remote_name = b.remote.name
        assert hit.hit_tokens == 3 * C and hit.tiers == [remote_name] * 3
        reads = counting(b.remote, "get_many_into")
        loaded = b.load(hit)
        assert loaded.tokens == 3 * C and b.snapshot()["promotions"] == 3  # into B's DRAM
        assert reads == [3]  # one batch, not a read a chunk
        assert_same(loaded, kv, 3 * C)
        assert b.lookup(turn2).tiers == ["host"] * 3


def test_promoting_a_remote_run_never_evicts_another_chunk_of_the_hit(layout, valkey_standalone):
    """B's DRAM holds 3 chunks, chunk 0 of the hit among them (write-back: only there). Making
    room for the remote run 1-3 must not evict chunk 0 before the load reads it; the run that
    DRAM cannot take whole is read one chunk after the other, as before."""
    prefix = unique_prefix()
    tokens = list(range(4 * C))
    kv = make_kv(layout, 4 * C, seed=1)
    with store_on(layout, valkey_remote(valkey_standalone.address, prefix)) as a:
        assert a.save(tokens, kv).stored == 4
        assert a.flush(timeout=10)
    with store_on(layout, valkey_remote(valkey_standalone.address, prefix, write="back"), host_chunks=3) as b:
        assert b.save(tokens[:C], [tuple(t[:, :C] for t in p) for p in kv]).stored == 1
        hit = b.lookup(tokens)
        assert hit.hit_tokens == 4 * C and hit.tiers == ["host"] + [b.remote.name] * 3
        loaded = b.load(hit)
        assert loaded.tokens == 4 * C and loaded.tiers[0] == "host"
        assert_same(loaded, kv, 4 * C)


def test_a_prefix_shared_by_many_sessions_is_stored_once_remotely(layout, valkey_standalone):
    prefix = unique_prefix()
    system = list(range(2 * C))
    stores = [store_on(layout, valkey_remote(valkey_standalone.address, prefix)) for _ in range(3)]
    try:
        for i, store in enumerate(stores):
            tokens = system + list(range(1000 * (i + 1), 1000 * (i + 1) + C))
            store.lookup(tokens)
            store.save(tokens, make_kv(layout, 3 * C, seed=0))
            store.flush(timeout=10)
        keys = stores[0].remote.keys()
        assert len(keys) == 2 + 3  # the shared 2 chunks once, plus each session's own chunk
    finally:
        for store in stores:
            store.close()


def test_write_back_uploads_only_what_leaves_the_local_tiers(layout, valkey_standalone):
    prefix = unique_prefix()
    tokens = list(range(4 * C))
    kv = make_kv(layout, 4 * C, seed=2)
    with store_on(layout, valkey_remote(valkey_standalone.address, prefix, write="back"),
                  host_chunks=2) as a:
        a.save(tokens[: 2 * C], [tuple(t[:, : 2 * C] for t in p) for p in kv])
        assert a.flush(timeout=10) and a.remote.keys() == []  # still in DRAM: nothing uploaded
        a.save(tokens, kv)  # DRAM holds 2: the first two chunks go down to the remote tier
        assert a.flush(timeout=10)
        assert len(a.remote.keys()) == 2
        hit = a.lookup(tokens)
        assert hit.tiers == [a.remote.name] * 2 + ["host"] * 2
        assert_same(a.load(hit, promote=False), kv, 4 * C)


def test_tenants_never_see_each_others_chunks_and_a_shared_salt_shares(layout, valkey_standalone):
    prefix = unique_prefix()
    tokens = list(range(2 * C))
    with store_on(layout, valkey_remote(valkey_standalone.address, prefix), tenant="acme") as a:
        a.save(tokens, make_kv(layout, 2 * C))
        a.flush(timeout=10)
    with store_on(layout, valkey_remote(valkey_standalone.address, prefix), tenant="globex") as b:
        assert b.lookup(tokens).hit_tokens == 0
        assert b.lookup(tokens, tenant="acme").hit_tokens == 2 * C  # a salt shared on purpose
    with store_on(layout, valkey_remote(valkey_standalone.address, prefix), tenant="acme") as c:
        assert c.lookup(tokens).hit_tokens == 2 * C


def test_remote_down_at_start_then_back(layout, tmp_path):
    from kvtier.bench.servers import ValkeyServer, free_port

    port = free_port()
    tokens = list(range(2 * C))
    kv = make_kv(layout, 2 * C)
    with store_on(layout, valkey_remote(f"127.0.0.1:{port}", unique_prefix())) as a:
        t0 = time.monotonic()
        assert a.save(tokens, kv).stored == 2  # served locally
        assert a.flush(timeout=10)
        hit = a.lookup(tokens + list(range(500, 500 + C)))
        assert hit.hit_tokens == 2 * C and hit.tiers == ["host"] * 2
        assert time.monotonic() - t0 < 5
        snap = a.snapshot()
        assert snap["uploads"]["failed"] == 2 and snap["tiers"][a.remote.name]["io"]["errors"] >= 1
        server = ValkeyServer(tmp_path / "late", port=port).start()
        try:
            assert wait_until(lambda: save_new_and_uploaded(a, layout), timeout_s=10)
        finally:
            server.stop()


def save_new_and_uploaded(store: KVStore, layout) -> bool:
    """Save a chunk never seen before; whether an upload has succeeded by now."""
    first = int(time.monotonic_ns() % 10**9) * 100
    store.save(list(range(first, first + C)), make_kv(layout, C))
    store.flush(10)
    return store.snapshot()["uploads"]["uploaded"] >= 1


def test_remote_killed_stalled_or_corrupting_never_breaks_a_request(layout, valkey_private):
    valkey_private.start()
    prefix = unique_prefix()
    tokens = list(range(3 * C))
    kv = make_kv(layout, 3 * C, seed=9)
    with store_on(layout, valkey_remote(valkey_private.address, prefix)) as a:
        a.save(tokens, kv)
        assert a.flush(timeout=10)
    cfg = valkey_remote(valkey_private.address, prefix)
    # corrupted bytes: the damaged chunk and what follows it are recomputed, never returned
    raw = valkey_private.client()
    with store_on(layout, cfg) as b:
        keys = b.lookup(tokens).keys
        tag = f"{{{prefix}:{keys[1].hex()}}}"
        raw.setrange(f"{tag}:d", 100, b"\xff\xfe\xfd")
        loaded = b.load(b.lookup(tokens))
        assert loaded.tokens == C  # chunk 0 only
        assert_same(loaded, kv, C)
        assert b.snapshot()["tiers"][b.remote.name]["io"]["corrupt"] == 1
    # stalled past the timeout: lookups answer (misses) within about the timeout
    with store_on(layout, cfg) as c:
        valkey_private.process.pause()
        try:
            t0 = time.monotonic()
            assert c.lookup(tokens).hit_tokens == 0
            assert time.monotonic() - t0 < 3
        finally:
            valkey_private.process.resume()
    # killed: misses, then back on the same port (empty: it kept nothing), and working again
    with store_on(layout, cfg) as d:
        valkey_private.process.kill()
        assert d.lookup(tokens).hit_tokens == 0
        assert d.save(tokens, kv).stored == 3  # served locally
        valkey_private.restart()
        assert wait_until(lambda: save_new_and_uploaded(d, layout), timeout_s=10)


def test_remote_config_errors_name_the_problem(layout):
    with pytest.raises(ValueError, match="write"):
        RemoteConfig(ValkeyTierConfig(("127.0.0.1:1",), 1 << 20), write="sometimes")
    with pytest.raises(TypeError, match="ValkeyTierConfig or MooncakeTierConfig"):
        RemoteConfig({"address": "127.0.0.1:1"})
    with pytest.raises(TypeError, match="RemoteConfig"):
        StoreConfig(model="m", layout=layout, host=HostTierConfig(1 << 20), remote="valkey://x")


def test_each_tenant_lives_under_its_own_prefix_and_an_acl_confines_an_instance_to_its_tenant(layout, valkey_private):
    valkey_private.start()
    prefix = unique_prefix()
    admin = valkey_private.client()
    # an ACL user that may touch only tenant acme's keys (its chunks, index, budget, reservations)
    admin.execute_command("ACL", "SETUSER", "acme", "on", ">acme-pw", f"~{{{prefix}.t.acme}}*",
                          f"~{{{prefix}.t.acme:*", "+@all")

    def remote(**kw):
        return valkey_remote(valkey_private.address, prefix, tenant_prefixes=True, **kw)

    tokens = list(range(2 * C))
    with store_on(layout, remote()) as owner:
        owner.save(tokens, make_kv(layout, 2 * C, seed=1), tenant="acme")
        owner.save(tokens, make_kv(layout, 2 * C, seed=2))  # the shared tenant
        assert owner.flush(10)
    names = [k.decode() for k in admin.keys("*")]
    assert any(n.startswith(f"{{{prefix}.t.acme:") for n in names)
    assert any(n.startswith(f"{{{prefix}.shared:") for n in names)
    with store_on(layout, remote(username="acme", password="acme-pw")) as confined:
        hit = confined.lookup(tokens, tenant="acme")
        assert hit.tiers == ["valkey", "valkey"]
        assert_same(confined.load(hit), make_kv(layout, 2 * C, seed=1), 2 * C)
        assert confined.lookup(tokens).hit_tokens == 0  # the shared tenant: the ACL refuses it, a miss
        assert confined.cache.remote.stats.errors >= 1


def test_a_restarted_store_uploads_each_tenants_chunks_under_its_own_prefix(layout, valkey_private, tmp_path):
    """Write-back with an SSD: acme's chunks reach SSD, the store restarts (nothing of who
    saved what is left in memory), then the shared tenant's saves push acme's chunks off SSD
    into the remote tier. Each goes under acme's prefix (its SSD header says whose it is), none
    under the shared one, and a lookup of acme's promises only what a load delivers."""
    valkey_private.start()
    prefix = unique_prefix()
    admin = valkey_private.client()

    def remote():
        return valkey_remote(valkey_private.address, prefix, write="back", tenant_prefixes=True)

    acme_tokens = list(range(4 * C))
    acme_kv = make_kv(layout, 4 * C, seed=7)
    with store_on(layout, remote(), host_chunks=2, disk_path=tmp_path / "ssd") as first:
        first.save(acme_tokens, acme_kv, tenant="acme")
        acme_keys = first.keys_for(acme_tokens, tenant="acme")
        assert first.flush(10)
        assert all(first.cache.disk.contains(k) or first.host.contains(k) for k in acme_keys)
    with store_on(layout, remote(), host_chunks=2, disk_path=tmp_path / "ssd") as again:
        on_ssd = [k for k in acme_keys if again.cache.disk.contains(k)]
        assert on_ssd and all(again.cache.disk.tenant_of(k) == "acme" for k in on_ssd)
        for i in range(12):  # the shared tenant fills SSD: acme's chunks go down to the remote tier
            tokens = [100_000 + 1_000 * i + t for t in range(2 * C)]
            again.save(tokens, make_kv(layout, 2 * C, seed=i))
        assert again.flush(10)
        assert not any(again.cache.disk.contains(k) for k in on_ssd)
    names = [k.decode() for k in admin.keys("*")]
    for k in on_ssd:
        mine = [n for n in names if k.hex() in n]
        assert mine and all(n.startswith(f"{{{prefix}.t.acme:") for n in mine), mine
    with store_on(layout, remote(), host_chunks=8) as third:  # another machine: no SSD of its own
        hit = third.lookup(acme_tokens, tenant="acme")
        loaded = third.load(hit)
        assert hit.hit_tokens >= C * (acme_keys[0] in on_ssd) and hit.tiers == ["valkey"] * len(hit.keys)
        assert loaded.tokens == hit.hit_tokens  # promised is delivered
        assert_same(loaded, acme_kv, hit.hit_tokens)
        assert third.lookup(acme_tokens).hit_tokens == 0  # the shared tenant's keys differ anyway


def test_what_the_store_remembers_of_the_remote_tier_stays_bounded_under_uploads(layout, valkey_standalone,
                                                                              monkeypatch):
    """Uploads add to what the store knows is remote; a write-heavy instance whose lookups hit
    locally never probes, and used to grow that record for ever."""
    from kvtier.store import remote_level

    monkeypatch.setattr(remote_level, "MAX_REMOTE_KEYS", 5)
    with store_on(layout, valkey_remote(valkey_standalone.address, unique_prefix()), host_chunks=16) as store:
        for i in range(6):
            store.save([10_000 * i + t for t in range(2 * C)], make_kv(layout, 2 * C, seed=i))
        assert store.flush(10)
        level = store.cache._remote_level
        assert len(level._seen) <= 5 and len(level._tenants) <= 5
        assert store.cache.remote.stats.as_dict()["writes"] >= 12  # all were uploaded
