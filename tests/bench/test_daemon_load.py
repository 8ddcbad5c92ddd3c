"""The daemon load test, run tiny: its invariants (no wrong byte, no leak, everything stopped and
removed) and the structure of its figures, never their speed."""

from __future__ import annotations

import json
import math
import multiprocessing
import os

import pytest
import torch
from click.testing import CliRunner

from kvtier.bench.daemon_clients import CONV_STRIDE, Conversations, wrong_tokens
from kvtier.bench.daemon_config import DaemonBenchConfig
from kvtier.bench.daemon_report import Latency
from kvtier.cli import main

TINY = ["--seconds", "3", "--idle-seconds", "1", "--workers", "2", "--kill-every", "1.2",
        "--storm-rate", "300", "--dram-chunks", "48"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One real run through the CLI (daemon, workers, storm, probe, kills): its JSON and the
    directory it worked in."""
    parent = tmp_path_factory.mktemp("daemon-load")
    result = CliRunner().invoke(main, ["bench", "daemon", *TINY, "--dir", str(parent), "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output), parent


def test_no_wrong_byte_is_loaded(run):
    data, _ = run
    ops = data["ops"]
    assert ops["loads"] > 0 and ops["saves"] > 0 and ops["revisits"] > 0 and ops["prefetches"] > 0
    assert data["verified_tokens"] >= ops["verified_tokens"] > 0
    assert data["audit"]["conversations"] > 0 and data["audit"]["tokens"] > 0
    assert data["wrong_tokens"] == ops["wrong_tokens"] == data["audit"]["wrong_tokens"] == 0
    assert data["ok"] is True


def test_nothing_leaks_though_workers_are_killed(run):
    data, _ = run
    assert data["workers_killed"] >= 1 and data["workers_restarted"] >= data["workers_killed"]
    assert data["worker_crashes"] == 0
    assert data["leaks"] == {"pinned_chunks": 0, "writes_in_flight": 0, "orphaned_writes": 0,
                             "dram_pins": 0, "dram_reservations": 0}  # per lease, and in the DRAM tier itself
    assert data["settled_s"] is not None and data["flush_s"] is not None
    assert data["daemon"]["clients_after"] == 1  # only the benchmark's own stats connection
    assert data["client_errors"] == 0 and data["latency"]["probe_errors"] == 0


def test_eviction_to_ssd_and_promotions_really_ran(run):
    daemon = run[0]["daemon"]
    assert daemon["demotions"] > 0 and daemon["host_evictions"] > 0
    assert daemon["promotions"] > 0 and daemon["disk_bytes_read"] > 0
    assert daemon["disk_chunks"] > run[0]["config"]["dram_chunks"]
    assert daemon["load_failures"] == 0 and daemon["disk_io_errors"] == 0


def test_the_index_places_no_more_chunks_in_dram_than_it_holds(run):
    # copy_many used to decide "present" before its batch read released the lock: a chunk
    # evicted meanwhile was then indexed in DRAM again, for good
    data, _ = run
    assert data["daemon"]["host_chunks"] <= data["config"]["dram_chunks"]


def test_latency_and_memory_figures_are_reported(run):
    data, _ = run
    lat = data["latency"]
    for phase in ("idle", "loaded"):
        fig = lat[phase]
        assert fig["count"] > 0
        assert 0 < fig["p50_ms"] <= fig["p99_ms"] <= fig["max_ms"]
    assert lat["p99_ratio"] == pytest.approx(lat["loaded"]["p99_ms"] / lat["idle"]["p99_ms"])
    assert data["meets_target"] == (lat["loaded"]["p99_ms"] < lat["target_p99_ms"])
    assert lat["probe_short_hits"] == 0
    mem = data["memory"]
    assert mem["samples"] >= 2
    assert 0 < mem["rss_anon_kib_start"] <= mem["rss_anon_kib_max"]
    assert mem["rss_anon_kib_end"] <= mem["rss_anon_kib_max"]
    assert math.isfinite(mem["rss_anon_growth_pct"])


def test_everything_is_stopped_and_removed(run):
    data, parent = run
    assert data["daemon_exit_code"] == 0 and data["arena_removed"] is True
    assert os.listdir(parent) == []  # socket, SSD tier, log: gone
    assert multiprocessing.active_children() == []


def test_table_output_and_bad_options():
    runner = CliRunner()
    bad = runner.invoke(main, ["bench", "daemon", "--dram-chunks", "4"])
    assert bad.exit_code == 2 and "dram_chunks must be at least 8" in bad.output
    bad = runner.invoke(main, ["bench", "daemon", "--seconds", "0"])
    assert bad.exit_code == 2


@pytest.mark.parametrize("kw, message", [
    ({"seconds": 0}, "seconds must be a number > 0"),
    ({"seconds": math.inf}, "seconds must be a number > 0"),
    ({"workers": 0}, "workers must be an int > 0"),
    ({"workers": True}, "workers must be an int > 0"),
    ({"kill_every_s": -1}, "kill_every_s must be a number >= 0"),
    ({"revisit": 1.0}, "revisit must be a share in [0, 1)"),
    ({"max_tokens": 16, "system_tokens": 0, "probe_tokens": 16}, "max_tokens (16) must hold two chunks"),
    ({"max_tokens": 640, "probe_tokens": 64}, "dram_chunks (48) must hold at least two of them"),
    ({"system_tokens": 320}, "system_tokens (320) must be below max_tokens"),
    ({"disk_bytes": 1 << 20}, "must be at least 4x the DRAM tier"),
    ({"directory": "/nonexistent/kvtier"}, "is not a directory"),
    ({"client_nice": 20}, "client_nice must be in [0, 19]"),
    ({"storm": 1}, "storm must be true or false"),
])
def test_config_is_validated(kw, message):
    with pytest.raises(ValueError) as err:
        DaemonBenchConfig(**kw)
    assert message in str(err.value)


def test_content_depends_on_the_conversation_and_position_only():
    config = DaemonBenchConfig()
    a, b = Conversations(config, cache=1), Conversations(config, cache=1)
    ids, kv = a.get(CONV_STRIDE + 3)
    other_ids, other_kv = a.get(CONV_STRIDE + 4)  # evicts the first from a's cache
    again_ids, again_kv = b.get(CONV_STRIDE + 3)
    assert ids == again_ids and torch.equal(kv, again_kv)
    s = config.system_tokens  # the system prompt is shared, the rest is not
    assert ids[:s] == other_ids[:s] and torch.equal(kv[:, :, :, :s], other_kv[:, :, :, :s])
    assert ids[s:] != other_ids[s:] and not torch.equal(kv[:, :, :, s:], other_kv[:, :, :, s:])
    assert wrong_tokens(kv, again_kv, config.max_tokens) == 0
    broken = kv.clone()
    broken[1, 0, 1, 5, 7] += 1  # one element of token 5
    broken[0, 1, 0, 9] = math.nan  # a token never copied
    assert wrong_tokens(broken, kv, config.max_tokens) == 2
    assert wrong_tokens(broken, kv, 5) == 0


def test_latency_percentiles():
    lat = Latency.of([i / 1e3 for i in range(1, 101)])  # 1..100 ms
    assert lat.count == 100 and lat.max_ms == pytest.approx(100)
    assert lat.p50_ms == pytest.approx(50.5) and lat.p99_ms == pytest.approx(99.01)
    assert Latency.of([]).count == 0 and math.isnan(Latency.of([]).p99_ms)
