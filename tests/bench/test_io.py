"""The I/O benchmark, run tiny: structure and sanity of its figures, never their speed."""

from __future__ import annotations

import math
import os

import pytest

from kvtier.bench import io
from kvtier.bench.io import IOBenchConfig, IOBenchResult, filesystem_type, run_io_bench
from kvtier.bench.io_workloads import BenchError
from kvtier.tiers.disk import DiskTier

FIGURES = ("read_GBps", "write_GBps", "baseline_read_GBps", "baseline_write_GBps")


def tiny(tmp_path, **kw) -> IOBenchConfig:
    args = {"sizes_mib": (1,), "total_mib": 2, "rounds": 1, "directory": str(tmp_path)}
    return IOBenchConfig(**(args | kw))


def check_figures(fig: dict) -> None:
    for name in FIGURES:
        assert isinstance(fig[name], float) and math.isfinite(fig[name]) and fig[name] > 0, name
    assert fig["read_ratio"] == pytest.approx(fig["read_GBps"] / fig["baseline_read_GBps"])
    assert fig["write_ratio"] == pytest.approx(fig["write_GBps"] / fig["baseline_write_GBps"])


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory) -> IOBenchResult:
    tmp = tmp_path_factory.mktemp("io")
    return run_io_bench(tiny(tmp, sizes_mib=(1, 2), total_mib=4, rounds=2))


def test_result_has_both_tiers_with_figures_per_size(two_sizes):
    data = two_sizes.as_dict()
    assert isinstance(data["direct_io"], bool)
    for tier in ("host", "disk"):
        check_figures(data[tier])
        assert set(data[tier]["by_size"]) == {"1MiB", "2MiB"}
        for size, fig in data[tier]["by_size"].items():
            check_figures(fig)
            assert fig["chunk_bytes"] == int(size[:-3]) << 20
            assert fig["bytes"] == fig["ops"] * fig["chunk_bytes"] == 4 << 20


def test_aggregate_is_total_bytes_over_total_time(two_sizes):
    for tier in ("host", "disk"):
        data = two_sizes.as_dict()[tier]
        for name in FIGURES:
            seconds = sum(f["bytes"] / (f[name] * 1e9) for f in data["by_size"].values())
            total = sum(f["bytes"] for f in data["by_size"].values())
            assert data[name] == pytest.approx(total / seconds / 1e9)


def test_temporary_directory_is_removed(tmp_path):
    result = run_io_bench(tiny(tmp_path))
    assert os.path.dirname(result.directory) == str(tmp_path)
    assert os.listdir(tmp_path) == []


def test_buffered_io_and_fsync_paths(tmp_path):
    result = run_io_bench(tiny(tmp_path, o_direct=False, fsync=True, statistic="best"))
    assert result.direct_io is False
    check_figures(result.as_dict()["disk"])


def test_a_tier_miss_is_an_error_not_a_fast_read(tmp_path, monkeypatch):
    monkeypatch.setattr(DiskTier, "get", lambda self, key, out=None, offset=0, length=None: None)
    with pytest.raises(BenchError, match="reads missed"):
        run_io_bench(tiny(tmp_path))
    assert os.listdir(tmp_path) == []


def test_unusable_directory_fails_before_measuring(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(io, "_run", lambda *a: pytest.fail("measured despite a bad directory"))
    with pytest.raises(ValueError, match="file"):
        run_io_bench(tiny(tmp_path, directory=str(blocker / "sub")))


@pytest.mark.parametrize(
    "kw",
    [
        {"sizes_mib": ()},
        {"sizes_mib": (0,)},
        {"sizes_mib": (1, -16)},
        {"sizes_mib": (16,), "total_mib": 8},
        {"rounds": 0},
        {"statistic": "mean"},
    ],
)
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        IOBenchConfig(**kw)


def test_filesystem_type_names_the_mount():
    assert filesystem_type("/") not in ("", "unknown") or not os.path.exists("/proc/mounts")
