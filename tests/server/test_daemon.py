"""The store daemon as its users meet it: a real `kvtier store serve` process, clients in this
and in other processes, crashes on both sides."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvtier.cli import main
from kvtier.core.layout import KVLayout
from kvtier.server.client import StoreClient
from kvtier.server.config import daemon_config
from kvtier.store import LookupResult

from ..conftest import make_kv
from ..daemon_process import KVTIER, DaemonProcess

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=16)
C = LAYOUT.chunk_tokens
MODEL = "tiny@test"


def write_config(tmp: Path, host_chunks: int = 8, write_through: bool = True, port: int | None = None,
                 extra: tuple[str, ...] = ()) -> Path:
    cfg = tmp / "kvtier.toml"
    lines = [
        f'socket = "{tmp / "kv.sock"}"', f"write_through = {str(write_through).lower()}",
        *([f"metrics_port = {port}"] if port is not None else []),
        "[host]", f"capacity_bytes = {host_chunks * LAYOUT.chunk_bytes}", f"extent_bytes = {LAYOUT.chunk_bytes}",
        "[disk]", f'path = "{tmp / "ssd"}"', 'capacity_bytes = "64MiB"',
        *extra,
    ]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


class Daemon(DaemonProcess):
    def __init__(self, tmp: Path, **kw) -> None:
        super().__init__(write_config(tmp, **kw), tmp / "kv.sock", tmp / "daemon.log")
        self.tmp = tmp

    def client(self, **kw) -> StoreClient:
        kw.setdefault("model", MODEL)
        kw.setdefault("layout", LAYOUT)
        return StoreClient(str(self.socket), **kw)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path).start()
    yield d
    d.stop()


def out_buffers(tokens: int, layout: KVLayout = LAYOUT):
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    return [tuple(torch.zeros(shape) for _ in range(2)) for _ in range(layout.num_layers)]


def assert_loaded(out, kv, tokens: int) -> None:
    for (k, v), (ok, ov) in zip(kv, out):
        assert torch.equal(ok[:, :tokens], k[:, :tokens]) and torch.equal(ov[:, :tokens], v[:, :tokens])


CHILD_SAVE = textwrap.dedent("""
    import sys, torch
    from kvtier.server.client import StoreClient
    from tests.conftest import make_kv
    from kvtier.core.layout import KVLayout
    layout = KVLayout(4, 2, 32, "float32", 16)
    client = StoreClient(sys.argv[1], model="tiny@test", layout=layout)
    res = client.save(list(range(int(sys.argv[2]))), make_kv(layout, int(sys.argv[2]), seed=7))
    print(res.stored, client.errors)
""")


def test_a_chunk_saved_by_one_process_is_loaded_by_another_through_shared_memory(daemon, tmp_path):
    n = 5 * C
    child = subprocess.run([sys.executable, "-c", CHILD_SAVE, str(daemon.socket), str(n)],
                           capture_output=True, text=True, cwd=Path(__file__).parents[2], check=True)
    assert child.stdout.split() == ["5", "0"]
    client = daemon.client()
    hit = client.lookup(list(range(n)))
    assert hit.hit_tokens == n
    out = out_buffers(n)
    assert client.load(hit, out).tokens == n
    assert_loaded(out, make_kv(LAYOUT, n, seed=7), n)
    stats = client.stats()
    assert stats["pinned_chunks"] == 0 and stats["tiers"]["host"]["hits"] == 5
    assert stats["loaded_tokens"] == {"host": n}  # what the engine took, by tier
    # the same prefix from a second conversation is stored once
    assert client.save(list(range(n)) + [1] * C, make_kv(LAYOUT, n + C, seed=7)).present == 5
    client.close()


def test_loads_and_saves_larger_than_dram_go_in_rounds_through_ssd(daemon):
    n = 12 * C  # DRAM holds 8 chunks
    kv = make_kv(LAYOUT, n, seed=3)
    client = daemon.client()
    assert client.save(list(range(n)), kv).stored == 12
    hit = client.lookup(list(range(n)))
    assert hit.hit_tokens == n and "disk" in hit.tiers
    out = out_buffers(n)
    assert client.load(hit, out).tokens == n
    assert_loaded(out, kv, n)
    client.close()


CHILD_DIE = textwrap.dedent("""
    import os, sys
    from kvtier.core.layout import KVLayout
    from kvtier.server.client import StoreClient
    client = StoreClient(sys.argv[1], model="tiny@test", layout=KVLayout(4, 2, 32, "float32", 16))
    keys = client.keys_for(list(range(64)))
    assert client.acquire(keys[:2]) is not None                     # pins two chunks
    lease = client.reserve([b"x" * 16])
    assert lease.views[0] is not None                               # a write never committed
    lease.views[0].fill_(7)
    print("holding", flush=True)
    os.kill(os.getpid(), 9)
""")


def test_a_client_killed_mid_operation_leaves_no_pins_and_no_half_written_chunk(daemon):
    client = daemon.client()
    client.save(list(range(4 * C)), make_kv(LAYOUT, 4 * C))
    proc = subprocess.run([sys.executable, "-c", CHILD_DIE, str(daemon.socket)], check=False,
                          capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert proc.stdout.strip() == "holding" and proc.returncode == -9, proc.stderr
    deadline = time.monotonic() + 10
    while (s := client.stats())["pinned_chunks"] or s["writes_in_flight"] or s["orphaned_writes"]:
        assert time.monotonic() < deadline, s  # the dead process's slot is freed (its pidfd)
        time.sleep(0.05)
    assert s["tiers"]["host"]["chunks"] == 4  # the abandoned write never became visible
    assert client.acquire([b"x" * 16]) is None
    client.close()


def test_daemon_down_at_start_then_up_later(tmp_path, caplog):
    d = Daemon(tmp_path)
    client = d.client(retry_s=0.05)
    tokens = list(range(3 * C))
    assert client.lookup(tokens).hit_tokens == 0
    assert client.save(tokens, make_kv(LAYOUT, 3 * C)).stored == 0
    out = out_buffers(3 * C)
    assert client.load(LookupResult(3 * C, 3 * C, [b"k" * 16] * 3, ["host"] * 3), out).tokens == 0
    assert client.errors >= 3 and "serving as cache misses" in caplog.text
    d.start()
    try:
        time.sleep(0.1)
        assert client.save(tokens, make_kv(LAYOUT, 3 * C)).stored == 3  # reconnected
        assert client.lookup(tokens).hit_tokens == 3 * C
    finally:
        client.close()
        d.stop()


def test_a_daemon_killed_mid_run_costs_misses_and_its_ssd_chunks_survive_a_restart(tmp_path):
    d = Daemon(tmp_path).start()  # write-through: every chunk also on SSD
    client = d.client(retry_s=0.05)
    tokens = list(range(6 * C))
    kv = make_kv(LAYOUT, 6 * C, seed=11)
    try:
        assert client.save(tokens, kv).stored == 6
        assert client.flush()  # the write-through copies are on SSD
        arena = client.stats()["arena"]
        assert os.path.exists(f"/dev/shm/{arena}")
        d.kill()
        assert client.lookup(tokens).hit_tokens == 0  # a miss, not an exception
        errors = client.errors
        assert errors >= 1
        d.start()
        time.sleep(0.1)
        hit = client.lookup(tokens)
        assert hit.hit_tokens == 6 * C and set(hit.tiers) == {"disk"}
        out = out_buffers(6 * C)
        assert client.load(hit, out).tokens == 6 * C
        assert_loaded(out, kv, 6 * C)
        assert not os.path.exists(f"/dev/shm/{arena}")  # the killed daemon's arena was removed
        assert client.stats()["arena"] != arena
    finally:
        client.close()
        d.stop()


def test_prometheus_metrics_over_http(tmp_path):
    d = Daemon(tmp_path, port=0).start()
    try:
        deadline = time.monotonic() + 10
        while "metrics on" not in (text := d.log.read_text()):
            assert time.monotonic() < deadline, "daemon did not report its metrics address"
            time.sleep(0.05)
        url = text.split("metrics on ", 1)[1].split()[0]
        client = d.client()
        client.save(list(range(2 * C)), make_kv(LAYOUT, 2 * C))
        client.load(client.lookup(list(range(2 * C))), out_buffers(2 * C))
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'kvtier_hits_total{tier="host"} 2.0' in body
        assert 'kvtier_hit_ratio{tier="host"} 1.0' in body
        assert f'kvtier_engine_tokens_total{{tier="host"}} {2 * C}.0' in body
        assert "kvtier_op_seconds_bucket" in body and 'op="commit"' in body
        assert "kvtier_prefetches_total 0.0" in body and "kvtier_evictions_total" in body
        client.close()
    finally:
        d.stop()


def test_a_queued_request_is_prefetched_from_ssd_by_the_daemon(tmp_path):
    daemon = Daemon(tmp_path, write_through=False).start()
    n = 12 * C  # DRAM holds 8 chunks: the deepest of the first 8 go down to SSD to make room
    client = daemon.client()
    client.save(list(range(n)), make_kv(LAYOUT, n, seed=3))
    keys = client.keys_for(list(range(8 * C)))
    assert client.lookup(list(range(8 * C))).tiers == ["host"] * 4 + ["disk"] * 4
    assert client.queued("req-0", keys, wait=True, prefetch=False) == 0  # heard of, nothing moved
    assert client.lookup(list(range(8 * C))).tiers == ["host"] * 4 + ["disk"] * 4
    assert client.queued("req-1", keys, wait=True) == 4
    client.started("req-1")
    assert client.lookup(list(range(8 * C))).tiers == ["host"] * 8
    stats = client.stats()
    assert stats["prefetched"] == 4 and stats["promotions"] == 4
    assert client.errors == 0
    client.close()
    daemon.stop()


def test_store_stats_command(daemon):
    client = daemon.client()
    client.save(list(range(2 * C)), make_kv(LAYOUT, 2 * C))
    assert client.flush()
    client.close()
    runner = CliRunner()
    res = runner.invoke(main, ["store", "stats", "--socket", str(daemon.socket), "--json"])
    assert res.exit_code == 0, res.output
    snap = json.loads(res.output)
    assert snap["tiers"]["host"]["chunks"] == 2 and snap["tiers"]["disk"]["chunks"] == 2
    res = runner.invoke(main, ["store", "stats", "--socket", str(daemon.socket)])
    assert res.exit_code == 0 and "kvtier store at" in res.output and "pinned chunks 0" in res.output
    res = runner.invoke(main, ["store", "stats", "--socket", str(daemon.tmp / "nobody.sock")])
    assert res.exit_code == 1 and "no kvtier daemon" in res.output


def test_garbage_on_the_socket_drops_that_client_only(daemon):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(daemon.socket))
    s.sendall(b"\xff\xff\xff\x7f" + b"junk")  # claims a 2 GiB message
    s.close()
    client = daemon.client()
    assert client.save(list(range(C)), make_kv(LAYOUT, C)).stored == 1
    client.close()


def test_bad_config_is_refused_with_a_clear_error(tmp_path):
    base = {"socket": str(tmp_path / "s.sock"), "host": {"capacity_bytes": "1MiB"}}
    assert daemon_config(base).cache.host.capacity_bytes == 1 << 20
    coded = daemon_config({**base, "disk": {"path": str(tmp_path / "d"), "capacity_bytes": "1GiB",
                                             "codec": "auto", "max_kl": 0.01}})
    assert (coded.cache.disk.codec, coded.cache.disk.max_kl) == ("auto", 0.01)
    for bad, words in [
        ({**base, "colour": "red"}, "unknown key"),
        ({**base, "host": {"capacity_bytes": 1 << 20, "size": 3}}, r"unknown key\(s\) in \[host\]"),
        ({k: v for k, v in base.items() if k != "host"}, r"\[host\] is missing"),
        ({**base, "socket": str(tmp_path / "no" / "such" / "s.sock")}, "not a writable directory"),
        ({**base, "host": {"capacity_bytes": "lots"}}, "host.capacity_bytes must be a size"),
        ({**base, "model": "m"}, "serves any model"),
        ({**base, "write_through": "yes"}, "write_through must be true or false"),
        ({**base, "disk": {"path": str(tmp_path / "d"), "capacity_bytes": "1GiB", "fsync": "no"}},
         "disk.fsync must be true or false"),
        ({**base, "metrics_port": 70000}, "metrics_port must be a TCP port"),
        ({**base, "metrics_port": "9400"}, "metrics_port must be an integer"),
        ({**base, "policy": "optimal"}, "offline bound"),
        ({**base, "access": {"mode": "rw"}}, "octal mode"),
        ({**base, "access": {"tenants": {"1001": "acme"}}}, "list of tenant names"),
        ({**base, "disk": {"path": str(tmp_path / "d"), "capacity_bytes": "1GiB", "codec": "zstd"}},
         "disk: codec must be one of"),
        ({**base, "disk": {"path": str(tmp_path / "d"), "capacity_bytes": "1GiB", "max_kl": "low"}},
         "disk.max_kl must be a number"),
        ({**base, "remote": {"backend": "valkey", "valkey": {"addresses": ["127.0.0.1:1"],
                                                              "capacity_bytes": "1GiB", "codec": "int3"}}},
         "valkey: codec must be one of"),
    ]:
        with pytest.raises(ValueError, match=words):
            daemon_config(bad)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("socket = \n")
    res = CliRunner().invoke(main, ["store", "serve", "--config", str(bad_toml)])
    assert res.exit_code == 1 and "not valid TOML" in res.output
    res = CliRunner().invoke(main, ["store", "serve", "--model", "m@1", "--host-bytes", "1MiB"])
    assert res.exit_code == 2 and "serves any model" in res.output


def test_a_second_daemon_on_the_same_socket_is_refused(daemon):
    res = subprocess.run([KVTIER, "store", "serve", "--config", str(daemon.config)], check=False,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "another daemon is serving" in res.stderr


def test_the_remote_tier_is_configured_in_its_own_section(tmp_path):
    base = {"socket": str(tmp_path / "s.sock"), "host": {"capacity_bytes": 1 << 20}}
    cfg = daemon_config({**base, "remote": {
        "backend": "valkey", "write": "back",
        "valkey": {"addresses": ["127.0.0.1:6390"], "capacity_bytes": "1GiB", "password": "pw"}}})
    remote = cfg.cache.remote
    assert remote.write == "back" and remote.tier.addresses == ("127.0.0.1:6390",)
    assert remote.tier.password == "pw" and remote.tier.capacity_bytes == 1 << 30
    cfg = daemon_config({**base, "remote": {
        "backend": "mooncake", "mooncake": {"master_address": "127.0.0.1:50051", "capacity_bytes": 1 << 30}}})
    assert cfg.cache.remote.tier.master_address == "127.0.0.1:50051"
    for bad, words in [
        ({"backend": "redis"}, "backend must be 'valkey' or 'mooncake'"),
        ({"backend": "valkey"}, r"\[remote.valkey\] is missing"),
        ({"backend": "valkey", "valkey": {"addresses": ["x"], "capacity_bytes": 1}}, "host:port"),
        ({"backend": "valkey", "colour": 1}, r"unknown key\(s\) in \[remote\]"),
        ({"backend": "valkey", "write": "never",
          "valkey": {"addresses": ["127.0.0.1:1"], "capacity_bytes": 1}}, "write must be"),
        ({"backend": "valkey", "valkey": {"addresses": ["127.0.0.1:1"], "capacity_bytes": 1,
                                          "ssl_ca_file": "/nope"}}, "ssl"),
        ({"backend": "valkey", "valkey": {"addresses": ["127.0.0.1:1"], "capacity_bytes": 1,
                                          "cluster": "false"}}, "remote.valkey.cluster must be true or false"),
    ]:
        with pytest.raises(ValueError, match=words):
            daemon_config({**base, "remote": bad})


def test_a_probe_says_which_keys_are_held_each_on_its_own_and_counts_nothing(daemon):
    client = daemon.client()
    tokens = list(range(3 * C))
    client.save(tokens, make_kv(LAYOUT, 3 * C, seed=3))
    keys = client.keys_for(tokens)
    other = client.keys_for([9] * C)[0]
    before = client.stats()
    assert client.probe([other, keys[2], keys[0]]) == [None, "host", "host"]  # not a prefix
    after = client.stats()
    assert (after["lookups"], after["tiers"]["host"]["hits"]) == (before["lookups"], before["tiers"]["host"]["hits"])
    assert daemon.client(model="another@model").probe(keys) == [None] * 3  # other namespaces: nothing
    client.close()


@pytest.mark.parametrize("page_format", ["", "vllm-cpu_attn-float32-bs16"])
def test_a_daemon_with_a_compressed_ssd_serves_chunks_within_the_codec_bound(tmp_path, page_format):
    from kvtier.tiers.codec_types import KVFormat
    from kvtier.tiers.codecs import error_bound

    d = Daemon(tmp_path, write_through=False, extra=('codec = "int8"',)).start()
    try:
        n = 12 * C  # DRAM holds 8: four go down to SSD, compressed
        kv = make_kv(LAYOUT, n, seed=9)
        client = d.client(page_format=page_format)
        assert client.save(list(range(n)), kv).stored == 12
        hit = client.lookup(list(range(n)))
        assert hit.hit_tokens == n and hit.tiers.count("disk") == 4
        out = out_buffers(n)
        assert client.load(hit, out).tokens == n
        # kvtier's own layout quantizes keys per channel; an engine's pages per row
        fmt = KVFormat("float32", LAYOUT.head_dim, 1 if page_format else 2)
        for (k, v), (ok, ov) in zip(kv, out):
            for i, tier in enumerate(hit.tiers):
                sl = slice(i * C, (i + 1) * C)
                want = torch.stack([k[:, sl], v[:, sl]]).contiguous()
                got = torch.stack([ok[:, sl], ov[:, sl]])
                if tier == "host":
                    assert torch.equal(got, want)
                else:
                    bound = error_bound("int8", want.view(-1).view(torch.uint8), fmt).view_as(want)
                    assert bool(((got - want).abs() <= bound).all()) and not torch.equal(got, want)
        client.close()
    finally:
        d.stop()
