"""The Valkey tier against real valkey-server processes: the tier contract on a standalone server
and on a 3-node cluster, then the faults (server down at start, killed, stalled, corrupted
bytes, wrong password, TLS) and the sharing between processes."""

import time

import pytest
import torch

from kvtier.tiers.base import TierFullError
from kvtier.tiers.remote_format import header_len
from kvtier.tiers.valkey import ValkeyTier, ValkeyTierConfig
from tests.remote_servers import TLSProxy, unique_prefix, wait_until

from .tier_contract import ENTRY, SEGMENT, TierContract, data, key, try_put

PER_ENTRY = header_len(ENTRY // SEGMENT) + ENTRY


def open_tier(addresses, capacity=1 << 30, **kw) -> ValkeyTier:
    kw.setdefault("prefix", unique_prefix())
    return ValkeyTier(ValkeyTierConfig(tuple(addresses), capacity, **kw))


class TestValkeyStandaloneContract(TierContract):
    @pytest.fixture(autouse=True)
    def _server(self, valkey_standalone):
        self.addresses = [valkey_standalone.address]

    def make_tier(self, capacity_entries: int) -> ValkeyTier:
        return open_tier(self.addresses, capacity_entries * PER_ENTRY)


class TestValkeyClusterContract(TierContract):
    @pytest.fixture(autouse=True)
    def _server(self, valkey_cluster):
        self.addresses = valkey_cluster.addresses

    def make_tier(self, capacity_entries: int) -> ValkeyTier:
        return open_tier(self.addresses, capacity_entries * PER_ENTRY, cluster=True)


def test_the_cluster_spreads_chunks_over_its_nodes_and_keeps_one_index(valkey_cluster):
    with open_tier(valkey_cluster.addresses, cluster=True) as tier:
        for i in range(30):
            assert tier.put(key(i), data(i), SEGMENT)
        assert tier.keys() == [key(i) for i in range(30)]  # oldest first, from any node
        per_node = [n.client().dbsize() for n in valkey_cluster.nodes]
        assert all(n > 0 for n in per_node) and sum(per_node) >= 60
        assert torch.equal(tier.get(key(7), offset=5000, length=6000), data(7)[5000:11000])


def commands_sent(clients, call) -> list[list[str]]:
    """The commands ``call()`` makes the servers run, from their slowlogs (every command logged
    while it runs; the slowlog threshold is put back after)."""
    for c in clients:
        c.config_set("slowlog-log-slower-than", 0)
        c.slowlog_reset()
    try:
        call()
        logged = [entry for c in clients for entry in c.slowlog_get(128)]
    finally:
        for c in clients:
            c.config_set("slowlog-log-slower-than", 10000)
    sent = []
    for entry in logged:
        cmd = entry["command"]
        args = (cmd.decode() if isinstance(cmd, bytes) else cmd).split()
        if args[0].upper() not in ("SLOWLOG", "CONFIG"):
            sent.append(args)
    return sent


@pytest.mark.parametrize("cluster", [False, True])
def test_oldest_is_one_bounded_range_of_the_index(cluster, request):
    """What the uploader evicts when the shared tier is full: the first n of the index in one
    ``ZRANGE idx 0 n-1``, not the whole index (which ``keys`` reads)."""
    servers = request.getfixturevalue("valkey_cluster" if cluster else "valkey_standalone")
    nodes = servers.nodes if cluster else [servers]
    addresses = servers.addresses if cluster else [servers.address]
    with open_tier(addresses, cluster=cluster) as tier:
        for i in range(40):
            assert tier.put(key(i), data(i, 4096), 4096)
        got = []
        sent = commands_sent([n.client() for n in nodes], lambda: got.append(tier.oldest(3)))
        assert got == [[key(0), key(1), key(2)]]
        assert sent == [["ZRANGE", f"{{{tier.config.prefix}}}:idx", "0", "2"]]
        assert tier.oldest(0) == [] and tier.oldest(100) == tier.keys()


def test_two_processes_share_chunks_index_and_budget(valkey_standalone):
    prefix = unique_prefix()
    a = open_tier([valkey_standalone.address], 3 * PER_ENTRY, prefix=prefix)
    b = open_tier([valkey_standalone.address], 3 * PER_ENTRY, prefix=prefix)
    assert a.put(key(1), data(1), SEGMENT) and b.put(key(2), data(2), SEGMENT)
    assert a.keys() == b.keys() == [key(1), key(2)]
    assert torch.equal(b.get(key(1)), data(1)) and b.entry_bytes(key(1)) == ENTRY
    assert a.used == b.used == 2 * PER_ENTRY
    res = a.reserve(key(3), ENTRY, SEGMENT)  # the last room, taken for everyone
    with pytest.raises(TierFullError):
        b.put(key(4), data(4), SEGMENT)
    with pytest.raises(ValueError, match="being written"):
        b.reserve(key(3), ENTRY)
    assert not b.contains(key(3))
    res.buffer.copy_(data(3))
    assert a.commit(res) and torch.equal(b.get(key(3)), data(3))
    assert b.delete(key(1)) and not a.contains(key(1)) and a.get(key(1)) is None
    a.close()
    b.close()


def test_a_dead_writers_reservation_expires_and_its_space_returns(valkey_standalone):
    prefix = unique_prefix()
    dead = open_tier([valkey_standalone.address], 2 * PER_ENTRY, prefix=prefix, reservation_ttl_s=0.3)
    live = open_tier([valkey_standalone.address], 2 * PER_ENTRY, prefix=prefix, reservation_ttl_s=0.3)
    stale = dead.reserve(key(1), ENTRY, SEGMENT)  # the writer "dies" holding it
    assert live.used == PER_ENTRY
    time.sleep(0.4)
    assert live.put(key(2), data(2), SEGMENT) and live.put(key(3), data(3), SEGMENT)  # room again
    assert live.used == 2 * PER_ENTRY
    stale.buffer.copy_(data(1))
    assert dead.commit(stale) is False  # too late: refused, nothing published
    assert not live.contains(key(1)) and live.keys() == [key(2), key(3)]
    assert dead.stats.errors == 1


def test_corrupted_bytes_are_a_counted_miss_never_wrong_bytes(valkey_standalone, caplog):
    raw = valkey_standalone.client()
    with open_tier([valkey_standalone.address]) as tier:
        for i in range(4):
            tier.put(key(i), data(i), SEGMENT)
        tag = f"{{{tier.config.prefix}:{key(0).hex()}}}"
        raw.setrange(f"{tag}:d", 2 * SEGMENT + 17, b"\xff\x00")  # payload damage, segment 2
        # the untouched segments still verify on their own
        assert torch.equal(tier.get(key(0), offset=0, length=SEGMENT), data(0)[:SEGMENT])
        assert tier.get(key(0)) is None
        assert "checksum mismatch in segment 2" in caplog.text
        assert tier.stats.corrupt == 1 and tier.stats.errors == 1 and not tier.contains(key(0))
        assert raw.exists(f"{tag}:d") == 0  # the damaged object is gone
        tag1 = f"{{{tier.config.prefix}:{key(1).hex()}}}"
        raw.setrange(f"{tag1}:h", 40, b"\x01")  # header damage
        tag2 = f"{{{tier.config.prefix}:{key(2).hex()}}}"
        raw.set(f"{tag2}:d", b"short")  # truncated payload
        raw.delete(f"{{{tier.config.prefix}:{key(3).hex()}}}:d")  # lost payload
        assert tier.get(key(1)) is None and tier.get(key(2)) is None and tier.get(key(3)) is None
        assert tier.stats.corrupt == 3 and tier.stats.errors == 4
        assert tier.keys() == [] and tier.used == 0


def test_a_corrupted_chunk_in_a_batched_read_is_a_miss_and_the_rest_are_read(valkey_standalone):
    raw = valkey_standalone.client()
    with open_tier([valkey_standalone.address]) as tier:
        assert tier.put_many([key(i) for i in range(3)], [data(i) for i in range(3)], SEGMENT) == [True] * 3
        raw.setrange(f"{{{tier.config.prefix}:{key(1).hex()}}}:d", 3 * SEGMENT + 5, b"\x00\xff")
        outs = [torch.zeros(ENTRY, dtype=torch.uint8) for _ in range(4)]
        got = tier.get_many_into([key(0), key(1), key(2), key(7)], outs, lambda _: None)
        assert got == [True, False, True, False]
        assert torch.equal(outs[0], data(0)) and torch.equal(outs[2], data(2))
        assert tier.stats.corrupt == 1 and tier.stats.misses == 2 and not tier.contains(key(1))


def test_a_batch_of_many_small_puts_is_one_round_trip_that_works(valkey_standalone):
    """400 uploads pile up more buffers than one sendmsg takes (1024 at most on Linux)."""
    with open_tier([valkey_standalone.address]) as tier:
        keys, datas = [key(i) for i in range(400)], [data(i, 1024) for i in range(400)]
        assert tier.put_many(keys, datas, 1024) == [True] * 400
        outs = [torch.zeros(1024, dtype=torch.uint8) for _ in range(400)]
        assert tier.get_many_into(keys, outs, lambda _: None) == [True] * 400
        assert all(torch.equal(o, d) for o, d in zip(outs, datas)) and tier.health.up


def test_server_down_at_start_then_up(valkey_private):
    tier = open_tier([valkey_private.address], timeout_s=0.5, reconnect_interval_s=0.2)
    assert tier.get(key(1)) is None and not tier.contains(key(1)) and tier.keys() == []
    with pytest.raises(TierFullError, match="unavailable"):
        tier.put(key(1), data(1), SEGMENT)
    assert tier.stats.misses == 1 and tier.stats.errors >= 1
    valkey_private.start()
    wait_until(lambda: try_put(tier, 1))
    assert torch.equal(tier.get(key(1)), data(1))
    tier.close()


def test_server_killed_mid_run_then_restarted(valkey_private):
    valkey_private.start()
    tier = open_tier([valkey_private.address], timeout_s=0.5, reconnect_interval_s=0.2)
    assert tier.put(key(1), data(1), SEGMENT)
    valkey_private.process.kill()
    t0 = time.monotonic()
    assert tier.get(key(1)) is None and tier.delete(key(1)) is False
    assert time.monotonic() - t0 < 1.5
    assert tier.stats.errors >= 1
    valkey_private.process.start()  # same port, empty (no persistence)
    wait_until(lambda: try_put(tier, 2))
    assert tier.get(key(1)) is None and torch.equal(tier.get(key(2)), data(2))
    tier.close()


def test_a_stalled_server_times_out_then_recovers(valkey_private):
    valkey_private.start()
    tier = open_tier([valkey_private.address], timeout_s=0.5, reconnect_interval_s=0.2)
    assert tier.put(key(1), data(1), SEGMENT)
    valkey_private.process.pause()
    try:
        t0 = time.monotonic()
        assert tier.get(key(1)) is None
        assert not tier.contains(key(1))  # down: fails fast, no second wait
        assert time.monotonic() - t0 < 1.2
        assert tier.stats.errors >= 1
    finally:
        valkey_private.process.resume()
    got = wait_until(lambda: tier.get(key(1)))
    assert torch.equal(got, data(1))
    tier.close()


def test_password_auth_and_a_wrong_password(tmp_path, caplog):
    from kvtier.bench.servers import ValkeyServer

    server = ValkeyServer(tmp_path, password="s3cret").start()
    try:
        with open_tier([server.address], password="s3cret") as good:
            assert good.put(key(1), data(1), SEGMENT) and torch.equal(good.get(key(1)), data(1))
        with open_tier([server.address], password="wrong", timeout_s=0.5) as bad:
            assert bad.get(key(1)) is None and bad.stats.errors == 1
        assert "WRONGPASS" in caplog.text or "invalid username-password" in caplog.text
        with open_tier([server.address], timeout_s=0.5) as none:
            assert none.keys() == [] and none.stats.errors == 1
    finally:
        server.stop()


def test_a_cluster_node_killed_loses_only_its_chunks(tmp_path):
    from kvtier.bench.servers import ValkeyCluster

    cluster = ValkeyCluster(tmp_path).start()
    try:
        tier = open_tier(cluster.addresses, cluster=True, timeout_s=0.5, reconnect_interval_s=0.1)
        for i in range(12):
            assert tier.put(key(i), data(i), SEGMENT)
        client = tier._conn.client
        port_of = {i: client.get_node_from_key(tier._data_keys(key(i))[1]).port for i in range(12)}
        index_port = client.get_node_from_key(tier._idx).port  # that node stays up
        others = [n for n in cluster.nodes if n.port != index_port]
        victim = max(others, key=lambda n: sum(p == n.port for p in port_of.values()))
        on_victim = {i for i, p in port_of.items() if p == victim.port}
        if not on_victim:
            pytest.skip("every chunk hashed to the index's node")  # rare: needs 12 of 12
        victim.process.kill()
        for i in range(12):
            time.sleep(0.15)  # past the reconnect interval: each read tries the servers
            t0 = time.monotonic()
            got = tier.get(key(i))
            assert time.monotonic() - t0 < 1.5
            assert (got is None) == (i in on_victim)
            assert got is None or torch.equal(got, data(i))
        victim.process.start()  # rejoins with its slots, empty
        survivors = {key(i) for i in range(12)} - {key(i) for i in on_victim}

        def healed() -> bool:  # a read of a lost chunk drops it from the index
            for i in on_victim:
                tier.get(key(i))
            return set(tier.keys()) == survivors

        wait_until(healed)
        tier.close()
    finally:
        cluster.stop()


def test_tls_against_a_plaintext_server_is_a_counted_failure(valkey_standalone):
    with open_tier([valkey_standalone.address], ssl=True, timeout_s=0.5) as tier:
        assert tier.get(key(1)) is None and tier.stats.errors == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"addresses": ()}, "addresses"),
        ({"addresses": ("localhost",)}, "addresses"),
        ({"addresses": ("a:1", "b:2")}, "exactly one"),
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"prefix": "a{b}"}, "prefix"),
        ({"prefix": ""}, "prefix"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"reconnect_interval_s": float("nan")}, "reconnect_interval_s"),
        ({"ssl_ca_file": "/etc/hostname"}, "ssl is off"),
        ({"ssl": True, "ssl_ca_file": "/no/such/file"}, "ssl_ca_file"),
        ({"ssl": True, "ssl_cert_file": "/etc/hostname"}, "go together"),
        ({"username": "u"}, "needs a password"),
    ],
)
def test_an_invalid_config_raises_naming_the_field(kwargs, field):
    base = {"addresses": ("127.0.0.1:6379",), "capacity_bytes": 1 << 20}
    with pytest.raises(ValueError, match=field):
        ValkeyTierConfig(**{**base, **kwargs})


def test_tls_with_client_certificates_and_a_server_it_cannot_verify(valkey_standalone, tmp_path):
    """The tier's TLS settings reach a real handshake: with the right CA and a client
    certificate chunks go through; a server certificate from another CA is refused (a miss, the
    tier down, nothing raised), and so is a client without a certificate."""
    import trustme

    ca, other_ca = trustme.CA(), trustme.CA()
    server_cert, client_cert = ca.issue_cert("127.0.0.1"), ca.issue_cert("kvtier-client")
    files = {}
    for name, blob in [("ca", ca.cert_pem), ("other_ca", other_ca.cert_pem),
                       ("server", server_cert.private_key_and_cert_chain_pem),
                       ("client_cert", client_cert.cert_chain_pems[0]), ("client_key", client_cert.private_key_pem)]:
        files[name] = str(tmp_path / f"{name}.pem")
        blob.write_to_path(files[name])
    host, port = valkey_standalone.address.split(":")
    proxy = TLSProxy((host, int(port)), (files["server"], files["server"]), client_ca=files["ca"])
    try:
        prefix = unique_prefix()
        tls = {"ssl": True, "ssl_ca_file": files["ca"], "timeout_s": 2.0}
        with open_tier([proxy.address], prefix=prefix, ssl_cert_file=files["client_cert"],
                       ssl_key_file=files["client_key"], **tls) as tier:
            assert tier.put(key(1), data(1), SEGMENT)
            assert torch.equal(tier.get(key(1)), data(1))
        with open_tier([valkey_standalone.address], prefix=prefix) as plain:  # the same server
            assert plain.contains(key(1))
        failed = proxy.handshakes_failed
        for kw in ({**tls, "ssl_ca_file": files["other_ca"], "ssl_cert_file": files["client_cert"],
                    "ssl_key_file": files["client_key"]}, tls):
            with open_tier([proxy.address], prefix=prefix, reconnect_interval_s=60.0, **kw) as tier:
                assert tier.get(key(1)) is None and not tier.contains(key(1))
                with pytest.raises(TierFullError, match="unavailable"):
                    tier.put(key(2), data(2), SEGMENT)
                assert tier.stats.errors >= 1 and tier.stats.misses == 1
        assert wait_until(lambda: proxy.handshakes_failed >= failed + 2, timeout_s=10)
    finally:
        proxy.close()


def test_puts_do_not_depend_on_how_valkey_py_packs_commands(valkey_standalone, monkeypatch):
    """With libvalkey installed, valkey-py's packer copies a memoryview into one bytes object;
    the tier's one-trip put packs its upload itself (it checksums the payload as it goes out)."""
    import valkey.connection

    real = valkey.connection.Connection.pack_command

    def copying(self, *args):
        return [b"".join(bytes(p) for p in real(self, *args))]

    monkeypatch.setattr(valkey.connection.Connection, "pack_command", copying)
    with open_tier([valkey_standalone.address]) as tier:
        assert tier.put(key(1), data(1, 1 << 20), SEGMENT)
        assert torch.equal(tier.get(key(1)), data(1, 1 << 20)) and tier.stats.corrupt == 0
