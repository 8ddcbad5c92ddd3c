"""The ``kvtier`` command line: options, JSON shape, errors. Benchmarks run tiny."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import main

TIER_KEYS = {"read_GBps", "write_GBps", "baseline_read_GBps", "baseline_write_GBps",
             "read_ratio", "write_ratio", "by_size"}
TINY = ["--sizes", "1", "--total-mib", "2", "--rounds", "1"]


def check_io_json(data: dict) -> None:
    assert isinstance(data["direct_io"], bool)
    for tier in ("host", "disk"):
        assert TIER_KEYS <= set(data[tier])
        assert set(data[tier]["by_size"]) == {"1MiB"}
        assert TIER_KEYS - {"by_size"} <= set(data[tier]["by_size"]["1MiB"])
        assert data[tier]["read_ratio"] == pytest.approx(
            data[tier]["read_GBps"] / data[tier]["baseline_read_GBps"])


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert "kvtier" in result.output and any(c.isdigit() for c in result.output)


def test_bench_io_json(tmp_path):
    result = CliRunner().invoke(main, ["bench", "io", "--json", "--dir", str(tmp_path), *TINY])
    assert result.exit_code == 0, result.output
    check_io_json(json.loads(result.stdout))


def test_bench_io_table(tmp_path):
    result = CliRunner().invoke(main, ["bench", "io", "--dir", str(tmp_path), *TINY])
    assert result.exit_code == 0, result.output
    for word in ("host", "disk", "ratio", "baseline", "1MiB", "all"):
        assert word in result.stdout


def test_bench_keys_json_and_table():
    result = CliRunner().invoke(main, ["bench", "keys", "--json", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["target_ms"] == 5.0 and data["num_tokens"] == 131072
    assert data["list"]["median_ms"] > 0 and data["numpy"]["median_ms"] > 0
    table = CliRunner().invoke(main, ["bench", "keys", "--repeats", "1"])
    assert table.exit_code == 0 and "numpy" in table.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes", "0"], "positive"),
        (["--sizes", "1,x"], "whole MiB"),
        (["--sizes", "16", "--total-mib", "8"], "total_mib"),
        (["--total-mib", "0"], "total-mib"),
    ],
)
def test_bench_io_bad_arguments(tmp_path, args, message):
    result = CliRunner().invoke(main, ["bench", "io", "--json", "--dir", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert os.listdir(tmp_path) == []


def test_bench_io_unwritable_dir(tmp_path):
    blocker = tmp_path / "plain-file"
    blocker.write_text("")
    bad = blocker / "sub"
    result = CliRunner().invoke(main, ["bench", "io", "--json", "--dir", str(bad), *TINY])
    assert result.exit_code != 0
    assert "Error" in result.output and str(blocker) in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def kvtier_script() -> str:
    script = Path(sys.executable).with_name("kvtier")
    found = str(script) if script.exists() else shutil.which("kvtier")
    if found is None:
        pytest.skip("the kvtier console script is not installed")
    return found


def test_installed_script_prints_json(tmp_path):
    proc = subprocess.run(
        [kvtier_script(), "bench", "io", "--json", "--dir", str(tmp_path), *TINY],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    check_io_json(json.loads(proc.stdout))


def test_installed_script_rejects_bad_sizes():
    proc = subprocess.run([kvtier_script(), "bench", "io", "--sizes", "0"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "Invalid value for '--sizes'" in proc.stderr
