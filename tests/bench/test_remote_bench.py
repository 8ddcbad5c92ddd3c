import json

import pytest
from click.testing import CliRunner

from kvtier.bench import servers
from kvtier.bench.remote import RATIO_TARGET, RemoteBenchConfig, run_remote_bench
from kvtier.cli import main

ROW_KEYS = {"backend", "size_bytes", "mode", "put_GBps", "raw_put_GBps", "get_GBps", "raw_get_GBps",
            "put_ratio", "get_ratio"}


@pytest.fixture(autouse=True)
def _binaries():
    for binary in (servers.valkey_server_binary, lambda: servers.mooncake_binary("mooncake_master")):
        try:
            binary()
        except servers.ServerError as exc:
            pytest.skip(str(exc))


def test_both_backends_with_tiny_objects_give_positive_ratios():
    result = run_remote_bench(RemoteBenchConfig(sizes=(64 << 10, 256 << 10), count=3, rounds=1))
    out = json.loads(json.dumps(result.as_dict()))
    assert out["target_ratio"] == RATIO_TARGET and out["count"] == 3 and out["rounds"] == 1
    assert [(r["backend"], r["size_bytes"], r["mode"]) for r in out["rows"]] == [
        (b, s, m) for b in ("valkey", "mooncake") for s in (64 << 10, 256 << 10) for m in ("each", "batch")]
    for row in out["rows"]:
        assert set(row) == ROW_KEYS
        assert all(row[k] > 0 for k in ROW_KEYS - {"backend", "size_bytes", "mode"})
        assert row["put_ratio"] == pytest.approx(row["put_GBps"] / row["raw_put_GBps"])


def test_the_command_prints_json_and_a_table():
    runner = CliRunner()
    res = runner.invoke(main, ["bench", "remote", "--backend", "valkey", "--sizes", "1",
                               "--count", "2", "--rounds", "1", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["rows"]
    assert [(r["backend"], r["size_bytes"], r["mode"]) for r in rows] == [("valkey", 1 << 20, "each"),
                                                                       ("valkey", 1 << 20, "batch")]
    assert rows[0]["get_ratio"] > 0
    res = runner.invoke(main, ["bench", "remote", "--backend", "valkey", "--sizes", "1",
                               "--count", "1", "--rounds", "1"])
    assert res.exit_code == 0, res.output
    assert "raw put" in res.output and "valkey" in res.output


def test_an_invalid_config_raises():
    with pytest.raises(ValueError, match="backends"):
        RemoteBenchConfig(backends=("redis",))
    with pytest.raises(ValueError, match="sizes"):
        RemoteBenchConfig(sizes=(100,))
    with pytest.raises(ValueError, match="count"):
        RemoteBenchConfig(count=0)
