"""What the daemon load test reports (:mod:`kvtier.bench.daemon_load`): lookup latencies, samples
of the daemon process, and the run's result with its invariants."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.bench.daemon_config import DaemonBenchConfig

P99_TARGET_MS = 2.0
"""Lookup p99 the daemon should keep under load."""


@dataclass(frozen=True, slots=True)
class Latency:
    """Wall times of the probe's lookups, in milliseconds."""

    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float

    @staticmethod
    def of(seconds: Sequence[float]) -> Latency:
        if not len(seconds):
            return Latency(0, math.nan, math.nan, math.nan, math.nan)
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        return Latency(len(ms), float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
                       float(ms.max()), float(ms.mean()))

    def as_dict(self) -> dict[str, object]:
        return {"count": self.count, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "max_ms": self.max_ms, "mean_ms": self.mean_ms}


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at the daemon process (``/proc/<pid>``)."""

    t: float
    rss_anon_kib: int
    rss_kib: int
    threads: int
    fds: int


@dataclass(frozen=True)
class DaemonBenchResult:
    config: DaemonBenchConfig
    cpus: int
    loaded_s: float
    """How long the loaded phase really ran."""
    ops: dict[str, int]
    """Summed over every worker instance (killed ones included) and the storm."""
    audit_conversations: int
    audit_tokens: int
    audit_wrong_tokens: int
    leaks: dict[str, int]
    """What the daemon still held ``settle_s`` after the workers stopped."""
    settled_s: float | None
    """How long the leaks took to drain after the flush, and every connection but the
    benchmark's own to end (None: they did not)."""
    flush_s: float | None
    """How long the daemon took, once the load stopped, to finish the background work queued
    (mostly the storm's prefetches; None: not within 300 s)."""
    daemon: dict[str, int]
    """The daemon's counters at the end of the run."""
    idle: Latency
    loaded: Latency
    probe_errors: int
    probe_short_hits: int
    """Probe lookups that found less than the whole held conversation."""
    samples: list[Sample] = field(repr=False)
    workers_killed: int = 0
    workers_restarted: int = 0
    worker_crashes: int = 0
    """Workers that exited on their own before the end (each also replaced)."""
    killed_pins_released: int = 0
    """Pins the daemon released for dead clients (its log)."""
    killed_writes_orphaned: int = 0
    """Reservations it orphaned for dead clients (its log), freed once the process was gone."""
    daemon_warnings: dict[str, int] = field(default_factory=dict)
    """Warnings and errors in the daemon's log, by message (numbers replaced by ``N``)."""
    daemon_exit_code: int | None = None
    """-9: it did not stop within 30 s of SIGTERM and was killed (its arena then removed here)."""
    daemon_stop_s: float | None = None
    """How long the daemon took to exit after SIGTERM."""
    arena_removed: bool = True
    """The daemon's shared-memory arena is gone from /dev/shm after the run."""
    daemon_lookups: dict[float, float] = field(default_factory=dict)
    """The daemon's own lookup handling times under load: bound in seconds -> lookups (every
    client's) that took at most that long, from its Prometheus histogram."""

    def daemon_side(self) -> dict[str, object]:
        """What share of lookups the daemon handled within 1 and 2 ms under load, and the
        histogram bucket its p99 falls in: the daemon's part of the latency, without the
        scheduling of the probe's process."""
        h = self.daemon_lookups
        total = h.get(math.inf, 0.0)
        if not total:
            return {}
        p99 = next((le for le in sorted(h) if h[le] >= 0.99 * total), math.inf)
        return {"lookups": int(total), "within_1ms": h.get(1e-3, 0.0) / total,
                "within_2ms": h.get(2e-3, 0.0) / total, "p99_at_most_ms": p99 * 1e3}

    @property
    def wrong_tokens(self) -> int:
        return self.ops["wrong_tokens"] + self.audit_wrong_tokens

    @property
    def leaked(self) -> int:
        return sum(self.leaks.values())

    @property
    def ok(self) -> bool:
        """The invariants: no wrong byte, no leak, no lease lost (nothing here times out)."""
        return self.wrong_tokens == 0 and self.leaked == 0 and self.ops["lost_leases"] == 0

    @property
    def meets_target(self) -> bool:
        return self.loaded.p99_ms < P99_TARGET_MS

    def memory(self) -> dict[str, object]:
        if not self.samples:
            return {}
        first, last = self.samples[0], self.samples[-1]
        mid = min(self.samples, key=lambda s: abs(s.t - (first.t + last.t) / 2))

        def growth(a: int, b: int) -> float:
            return (b - a) / a * 100 if a else math.nan

        return {
            "samples": len(self.samples),
            "rss_anon_kib_start": first.rss_anon_kib,
            "rss_anon_kib_mid": mid.rss_anon_kib,
            "rss_anon_kib_end": last.rss_anon_kib,
            "rss_anon_kib_max": max(s.rss_anon_kib for s in self.samples),
            "rss_anon_growth_pct": growth(first.rss_anon_kib, last.rss_anon_kib),
            "rss_anon_growth_second_half_pct": growth(mid.rss_anon_kib, last.rss_anon_kib),
            "rss_kib_end": last.rss_kib,
            "threads_start": first.threads,
            "threads_end": last.threads,
            "threads_max": max(s.threads for s in self.samples),
            "fds_start": first.fds,
            "fds_end": last.fds,
            "fds_max": max(s.fds for s in self.samples),
        }

    def as_dict(self) -> dict[str, object]:
        cfg = self.config
        ratio = self.loaded.p99_ms / self.idle.p99_ms if self.idle.count and self.idle.p99_ms else math.nan
        return {
            "ok": self.ok,
            "meets_target": self.meets_target,
            "config": {
                "seconds": cfg.seconds, "workers": cfg.workers, "dram_chunks": cfg.dram_chunks,
                "chunk_bytes": cfg.layout.chunk_bytes, "host_bytes": cfg.host_bytes,
                "disk_bytes": cfg.disk_bytes, "kill_every_s": cfg.kill_every_s,
                "idle_seconds": cfg.idle_seconds, "storm": cfg.storm, "storm_rate": cfg.storm_rate,
                "probe_interval_ms": cfg.probe_interval_ms, "think_ms": cfg.think_ms,
                "client_nice": cfg.client_nice,
                "max_tokens": cfg.max_tokens, "probe_tokens": cfg.probe_tokens, "seed": cfg.seed,
            },
            "cpus": self.cpus,
            "loaded_s": self.loaded_s,
            "ops": dict(self.ops),
            "verified_tokens": self.ops["verified_tokens"] + self.audit_tokens,
            "wrong_tokens": self.wrong_tokens,
            "audit": {"conversations": self.audit_conversations, "tokens": self.audit_tokens,
                      "wrong_tokens": self.audit_wrong_tokens},
            "leaks": dict(self.leaks),
            "settled_s": self.settled_s,
            "flush_s": self.flush_s,
            "daemon": dict(self.daemon),
            "latency": {
                "target_p99_ms": P99_TARGET_MS,
                "idle": self.idle.as_dict(),
                "loaded": self.loaded.as_dict(),
                "p50_ratio": self.loaded.p50_ms / self.idle.p50_ms if self.idle.count else math.nan,
                "p99_ratio": ratio,
                "probe_errors": self.probe_errors,
                "probe_short_hits": self.probe_short_hits,
                "daemon_side": self.daemon_side(),
            },
            "memory": self.memory(),
            "workers_killed": self.workers_killed,
            "workers_restarted": self.workers_restarted,
            "worker_crashes": self.worker_crashes,
            "killed_pins_released": self.killed_pins_released,
            "killed_writes_orphaned": self.killed_writes_orphaned,
            "client_errors": self.ops["errors"],
            "lost_leases": self.ops["lost_leases"],
            "daemon_warnings": dict(self.daemon_warnings),
            "daemon_exit_code": self.daemon_exit_code,
            "daemon_stop_s": self.daemon_stop_s,
            "arena_removed": self.arena_removed,
        }
