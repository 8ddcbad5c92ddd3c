"""I/O throughput of the host and disk tiers, each against a raw baseline measured in the same run.

What is measured, per chunk size (all sizes are whole MiB), over ``total_mib`` MiB of chunks:

- host tier: write = ``tier.put(key, src_i)`` (reserve, copy into the slot, commit); read =
  ``tier.get(key, out=dst_i)``. Baseline: ``base_i.copy_(src_i)`` and ``dst_i.copy_(base_i)``
  between tensors of the same total size (so neither side gets a cache-resident buffer).
- disk tier: write = ``tier.put`` from page-aligned memory (as the store demotes from host
  slots); read = ``tier.get(key, out=dst_i)`` into a page-aligned tensor. Baseline: one file per chunk, ``os.pwritev``/``os.preadv`` of the same sizes from and
  into page-aligned anonymous mappings on the same filesystem, with ``O_DIRECT`` if and only if
  the tier uses it, and the same fsync setting.

Fairness: tier and baseline move the same payload bytes in the same number of operations (the
tier's own overhead, such as its 4 KiB file header and checksums, counts against it). A
warm-up round (not timed) touches every buffer first; then each of ``rounds`` rounds times the
four phases, alternating which of tier and baseline goes first. ``os.sync()`` runs before every
timed disk phase so one phase's write-back does not land in the next. Without ``O_DIRECT`` the
page cache of every file is dropped (``fdatasync`` + ``POSIX_FADV_DONTNEED``) before reads, for
both sides. A tier miss or failed write raises
:class:`~kvtier.bench.io_workloads.BenchError` (a fast miss is not a read).

Statistics: per phase, the median (or best) of the rounds' times. Throughput is payload bytes /
time in GB/s (1e9 bytes). A tier's top-level figures aggregate its chunk sizes as **total bytes
/ total time** (the sum of the per-size times), and each ``*_ratio`` is tier / baseline of those
figures, so ``ratio == value / baseline`` holds at every level; ``by_size`` has the per-size
figures, whose ratios can be below the aggregate's (check them for a per-size target).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.bench.io_workloads import _DiskWork, _HostWork, _Workload
from kvtier.tiers.arena import PAGE
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_config import DiskTierConfig

MIB = 1 << 20
GB = 1e9
RATIO_TARGET = 0.7
"""A tier should reach at least this share of its raw baseline's throughput."""

STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median,
    "best": min,
}
"""How the rounds' times of one phase become one figure."""


@dataclass(frozen=True)
class IOBenchConfig:
    sizes_mib: tuple[int, ...] = (1, 16)
    total_mib: int = 256
    """Payload moved per phase and chunk size (for each of tier and baseline)."""
    rounds: int = 5
    directory: str | None = None
    """Where the disk benchmark makes its temporary directory; None: ``tempfile.gettempdir()``."""
    fsync: bool = False
    o_direct: bool = True
    statistic: str = "median"

    def __post_init__(self) -> None:
        if not self.sizes_mib or any(
            not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in self.sizes_mib
        ):
            raise ValueError(f"chunk sizes must be positive whole MiB, got {self.sizes_mib!r}")
        if not isinstance(self.total_mib, int) or self.total_mib < max(self.sizes_mib):
            raise ValueError(
                f"total_mib must be an int >= the largest chunk size ({max(self.sizes_mib)} MiB), "
                f"got {self.total_mib!r}"
            )
        if not isinstance(self.rounds, int) or self.rounds <= 0:
            raise ValueError(f"rounds must be a positive int, got {self.rounds!r}")
        if self.statistic not in STATISTICS:
            raise ValueError(
                f"statistic must be one of {sorted(STATISTICS)}, got {self.statistic!r}"
            )


@dataclass(frozen=True, slots=True)
class Throughput:
    """GB/s (1e9 bytes/s) of the four phases, and tier / baseline ratios."""

    write_GBps: float
    read_GBps: float
    baseline_write_GBps: float
    baseline_read_GBps: float

    @classmethod
    def of(cls, nbytes: int, times: tuple[float, float, float, float]) -> Throughput:
        """From seconds of (write, read, baseline write, baseline read) moving ``nbytes``."""
        return cls(*(nbytes / t / GB for t in times))

    @property
    def write_ratio(self) -> float:
        return self.write_GBps / self.baseline_write_GBps

    @property
    def read_ratio(self) -> float:
        return self.read_GBps / self.baseline_read_GBps

    def as_dict(self) -> dict[str, float]:
        return {"read_GBps": self.read_GBps, "write_GBps": self.write_GBps,
                "baseline_read_GBps": self.baseline_read_GBps,
                "baseline_write_GBps": self.baseline_write_GBps,
                "read_ratio": self.read_ratio, "write_ratio": self.write_ratio}


@dataclass(frozen=True, slots=True)
class SizeResult:
    """One chunk size: ``ops`` chunks per phase and the chosen seconds of each phase."""

    chunk_bytes: int
    ops: int
    times: tuple[float, float, float, float]
    """Seconds of (write, read, baseline write, baseline read)."""

    @property
    def bytes(self) -> int:
        return self.chunk_bytes * self.ops

    @property
    def label(self) -> str:
        return f"{self.chunk_bytes // MIB}MiB"

    @property
    def throughput(self) -> Throughput:
        return Throughput.of(self.bytes, self.times)

    def as_dict(self) -> dict[str, float | int]:
        return {"chunk_bytes": self.chunk_bytes, "ops": self.ops, "bytes": self.bytes,
                **self.throughput.as_dict()}


@dataclass(frozen=True, slots=True)
class TierResult:
    """All chunk sizes of one tier."""

    by_size: tuple[SizeResult, ...]

    @property
    def throughput(self) -> Throughput:
        """Aggregate over the chunk sizes: total bytes / total time, phase by phase."""
        w, r, bw, br = (sum(s.times[i] for s in self.by_size) for i in range(4))
        return Throughput.of(sum(s.bytes for s in self.by_size), (w, r, bw, br))

    def as_dict(self) -> dict[str, object]:
        return {**self.throughput.as_dict(),
                "by_size": {s.label: s.as_dict() for s in self.by_size}}


@dataclass(frozen=True, slots=True)
class IOBenchResult:
    host: TierResult
    disk: TierResult
    direct_io: bool
    """Whether the disk tier (and so its baseline) used O_DIRECT."""
    fs_type: str
    """Filesystem of the disk benchmark's directory (tmpfs would make the disk figures moot)."""
    directory: str
    config: IOBenchConfig
    load_avg_1m: float
    """System load when the run began: far above 0 means other work competed for the CPUs."""

    def as_dict(self) -> dict[str, object]:
        return {
            "host": self.host.as_dict(),
            "disk": self.disk.as_dict(),
            "direct_io": self.direct_io,
            "fs_type": self.fs_type,
            "directory": self.directory,
            "fsync": self.config.fsync,
            "rounds": self.config.rounds,
            "statistic": self.config.statistic,
            "total_mib": self.config.total_mib,
            "load_avg_1m": self.load_avg_1m,
        }


def filesystem_type(path: str) -> str:
    """Type of the filesystem holding ``path`` per ``/proc/mounts``; "unknown" elsewhere."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _source(nbytes: int) -> torch.Tensor:
    """Incompressible payload: a random block tiled over ``nbytes``."""
    block = min(nbytes, 16 * MIB)
    rand = torch.from_numpy(np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8))
    return rand.repeat(-(-nbytes // block))[:nbytes]


def _run(work: _Workload, rounds: int, stat: Callable[[list[float]], float]) -> SizeResult:
    times: dict[str, list[float]] = {}
    for rnd in range(rounds + 1):  # round 0 is the warm-up
        order = ("", "baseline_") if rnd % 2 == 0 else ("baseline_", "")
        for kind in ("write", "read"):
            if kind == "read":
                work.before_reads()
            for prefix in order:
                work.before_phase()
                start = time.perf_counter()
                getattr(work, prefix + kind)()
                if rnd:
                    times.setdefault(prefix + kind, []).append(time.perf_counter() - start)
        work.reset()
    phases = ("write", "read", "baseline_write", "baseline_read")
    w, r, bw, br = (stat(times[p]) for p in phases)
    return SizeResult(work.chunk, work.n, (w, r, bw, br))


def _make_root(directory: str | None) -> str:
    parent = tempfile.gettempdir() if directory is None else directory
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix="kvtier-bench-", dir=parent)
    except OSError as exc:
        raise ValueError(f"cannot create a benchmark directory under {parent!r}: {exc}") from exc


def run_io_bench(config: IOBenchConfig) -> IOBenchResult:
    """Run both tiers' benchmarks. Raises ValueError (before measuring anything) when
    ``config.directory`` is unusable, BenchError when a tier misses; the temporary directory is
    removed in every case."""
    stat = STATISTICS[config.statistic]
    load = os.getloadavg()[0]
    total = config.total_mib * MIB
    root = _make_root(config.directory)
    try:
        raw_dir = os.path.join(root, "raw")
        os.mkdir(raw_dir)
        capacity = 2 * (total + (total // MIB + 1) * 2 * PAGE)  # payload, headers, slack
        disk = DiskTier(DiskTierConfig(os.path.join(root, "tier"), capacity, config.fsync,
                                       config.o_direct))
        try:
            src = _source(total)
            host_sizes, disk_sizes = [], []
            for mib in config.sizes_mib:
                n = total // (mib * MIB)
                host = _HostWork(mib * MIB, n, src)
                try:
                    host_sizes.append(_run(host, config.rounds, stat))
                finally:
                    host.tier.close()
                work = _DiskWork(disk, mib * MIB, n, src, raw_dir, config.fsync)
                try:
                    disk_sizes.append(_run(work, config.rounds, stat))
                finally:
                    work.close()
            direct = disk.direct_io
        finally:
            disk.close()
        fs_type = filesystem_type(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return IOBenchResult(TierResult(tuple(host_sizes)), TierResult(tuple(disk_sizes)), direct,
                         fs_type, root, config, load)
