"""Load test of the store daemon: a real ``kvtier store serve`` process, several client processes,
a DRAM tier small enough that eviction to SSD never stops, a prefetch storm from SSD, and a
latency probe.

What runs (every client is a process of its own, started with the ``spawn`` method):

- **the daemon**, with ``dram_chunks`` chunks of DRAM and an SSD tier that holds everything;
- **workers** (``workers`` of them), each looping until told to stop: continue one of its
  conversations by a turn (lookup, load what hits, verify it, save the longer prefix), or now and
  then revisit any worker's old conversation (lookup, load, verify: mostly SSD promotions). Every
  ``kill_every_s`` seconds one worker is SIGKILLed, wherever it is, and replaced;
- **a prefetch storm**: ``prefetch(keys, wait=False)`` of old conversations (mostly on SSD), as
  fast as it can (or ``storm_rate`` a second);
- **a latency probe**: ``lookup`` of one fixed, held conversation every ``probe_interval_ms``,
  timed call by call -- first for ``idle_seconds`` on the idle daemon (nothing else runs), then
  through the whole loaded phase.

Deterministic content. Conversation ``c``'s token ids and the KV of its position ``p`` are
functions of ``(seed, c)`` and ``(seed, c, p)`` only (a shared system prompt first, the same for
every conversation), so any process can check any loaded token byte for byte. A token whose K or V
differs anywhere from what it must be is a *wrong token*; the load buffer is filled with NaN first,
so a token the client claims to have loaded but never copied counts as wrong too. After the run
a sample of all conversations (``audit``) is loaded and checked once more.

Leaks. After the workers stop, the daemon must hold no read pins, no write reservations and no
orphaned writes (a killed worker's pins end with its connection, its reservations once its process
is gone): these are polled for up to ``settle_s``; what is left then is a leak. The daemon's own
heap (``RssAnon`` of ``/proc/<pid>/status``: the DRAM arena is shared memory, allocated in full at
start), its threads and its open files are sampled every second of the loaded phase.

Reported: operations, tokens verified, wrong tokens (must be 0), leaks (must be 0), the daemon's
demotions and promotions (eviction to SSD and SSD traffic really happened), lookup p50/p99 idle and
under load (the target is p99 < :data:`P99_TARGET_MS` under load), RssAnon start/end/max, workers
killed and restarted, client errors. The figures are a benchmark, not a test: on a machine with
fewer cores than busy processes the latency measures the CPU scheduler as much as the daemon
(``cpus`` is reported next to them).
"""

from __future__ import annotations

import array
import contextlib
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.bench.daemon_clients import (
    CONV_STRIDE,
    COUNTERS,
    MODEL,
    STORM_ROW,
    Conversations,
    _buffers,
    _check,
    _client,
    _created,
    _probe,
    _Row,
    _seed,
    _storm,
    _worker,
)
from kvtier.core.layout import KVLayout
from kvtier.errors import DaemonUnavailable

P99_TARGET_MS = 2.0
"""Lookup p99 the daemon should keep under load."""
_ARENA = re.compile(r"kvtier-[0-9a-f]{32}")
_GONE = re.compile(r"gone: released (\d+) pins, orphaned (\d+) reservations")


@dataclass(frozen=True)
class DaemonBenchConfig:
    seconds: float = 120.0
    """Length of the loaded phase (workers, storm and probe running)."""
    workers: int = 3
    dram_chunks: int = 48
    """DRAM of the daemon, in chunks of the layout below."""
    kill_every_s: float = 20.0
    """SIGKILL a worker (and start another) this often; 0: never."""
    idle_seconds: float = 10.0
    """Probe lookups on the idle daemon, before the load starts."""
    storm: bool = True
    """Run the prefetch storm (off: the load is the workers alone, for comparison)."""
    storm_rate: float = 0.0
    """Prefetch requests a second of the storm; 0: as fast as it can."""
    probe_interval_ms: float = 1.0
    """The probe starts one lookup this often (a late one starts at once, none is skipped up)."""
    think_ms: float = 0.0
    """A worker sleeps this long after each step (an engine computing between calls)."""
    client_nice: int = 0
    """Niceness of the workers and the storm (the daemon and the probe keep the default): on a
    machine with fewer cores than busy processes, so that the probe measures the daemon rather
    than the CPU scheduler."""
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    chunk_tokens: int = 16
    system_tokens: int = 32
    """The system prompt every conversation starts with (its chunks are shared)."""
    max_tokens: int = 320
    """A conversation ends (and only gets revisited) at this length."""
    turn_tokens: int = 40
    """Mean tokens a turn adds (drawn from [turn_tokens / 2, 3 * turn_tokens / 2])."""
    probe_tokens: int = 256
    active: int = 4
    """Conversations a worker keeps going at once."""
    revisit: float = 0.25
    """Share of a worker's steps that reload an old conversation instead of a turn."""
    disk_bytes: int = 512 << 20
    directory: str | None = None
    """Parent of the temporary directory (socket, SSD tier, daemon log). Default: $TMPDIR."""
    settle_s: float = 10.0
    """How long pins and reservations may take to drain after the workers stop."""
    flush_s: float = 60.0
    """How long the daemon may take to finish its queued background work after the load."""
    audit: int = 64
    """Conversations loaded and checked once more after the run."""
    seed: int = 0

    def __post_init__(self) -> None:
        def positive(name: str, kind: type = int, zero: bool = False) -> None:
            value = getattr(self, name)
            ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
            if ok and kind is float:
                ok = math.isfinite(value)
            if not ok or value < 0 or (value == 0 and not zero):
                what = "a number" if kind is float else "an int"
                raise ValueError(f"{name} must be {what} {'>= 0' if zero else '> 0'}, got {value!r}")

        for name in ("seconds", "idle_seconds", "probe_interval_ms", "settle_s", "flush_s"):
            positive(name, float)
        for name in ("kill_every_s", "storm_rate", "think_ms"):
            positive(name, float, zero=True)
        for name in ("workers", "dram_chunks", "num_layers", "num_kv_heads", "head_dim", "chunk_tokens",
                     "max_tokens", "turn_tokens", "probe_tokens", "active", "disk_bytes"):
            positive(name)
        for name in ("system_tokens", "audit", "seed", "client_nice"):
            positive(name, zero=True)
        if not isinstance(self.storm, bool):
            raise ValueError(f"storm must be true or false, got {self.storm!r}")
        if self.client_nice > 19:
            raise ValueError(f"client_nice must be in [0, 19], got {self.client_nice}")
        if self.workers > 64:
            raise ValueError(f"workers must be at most 64, got {self.workers}")
        if self.dram_chunks < 8:
            raise ValueError(f"dram_chunks must be at least 8 (a daemon needs room for a few pins "
                             f"and writes at once), got {self.dram_chunks}")
        if not isinstance(self.revisit, (int, float)) or not 0 <= self.revisit < 1:
            raise ValueError(f"revisit must be a share in [0, 1), got {self.revisit!r}")
        c = self.chunk_tokens
        if self.system_tokens >= self.max_tokens:
            raise ValueError(f"system_tokens ({self.system_tokens}) must be below max_tokens "
                             f"({self.max_tokens})")
        if self.max_tokens < 2 * c or self.probe_tokens < c:
            raise ValueError(f"max_tokens ({self.max_tokens}) must hold two chunks and probe_tokens "
                             f"({self.probe_tokens}) one, of {c} tokens")
        if self.turn_tokens < 2:
            raise ValueError(f"turn_tokens must be at least 2, got {self.turn_tokens}")
        if self.probe_tokens > self.max_tokens:
            raise ValueError(f"probe_tokens ({self.probe_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        if self.max_tokens // c > self.dram_chunks // 2:
            raise ValueError(f"a conversation of max_tokens ({self.max_tokens}) is "
                             f"{self.max_tokens // c} chunks: dram_chunks ({self.dram_chunks}) must "
                             "hold at least two of them")
        if self.disk_bytes < 4 * self.dram_chunks * self.layout.chunk_bytes:
            raise ValueError(f"disk_bytes ({self.disk_bytes}) must be at least 4x the DRAM tier "
                             f"({self.dram_chunks * self.layout.chunk_bytes} bytes)")
        if self.directory is not None and not os.path.isdir(self.directory):
            raise ValueError(f"directory {self.directory!r} is not a directory")

    @property
    def layout(self) -> KVLayout:
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype="float32", chunk_tokens=self.chunk_tokens)

    @property
    def host_bytes(self) -> int:
        return self.dram_chunks * self.layout.chunk_bytes

    @property
    def max_instances(self) -> int:
        """Worker processes the run may start: the first ones, the replacements of killed ones,
        and room for replacing some that crashed."""
        kills = math.ceil(self.seconds / self.kill_every_s) + 1 if self.kill_every_s else 0
        return self.workers + kills + 16


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


# -- the daemon -----------------------------------------------------------------------------------
def _kvtier_command() -> list[str]:
    script = Path(sys.executable).with_name("kvtier")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtier.cli"]


class _Daemon:
    def __init__(self, config: DaemonBenchConfig, tmp: str) -> None:
        self.socket = os.path.join(tmp, "kv.sock")
        if len(os.fsencode(self.socket)) > 100:
            raise ValueError(f"the socket path {self.socket} is too long for a Unix socket: "
                             "use a shorter directory")
        self.log = os.path.join(tmp, "daemon.log")
        self.cmd = [*_kvtier_command(), "store", "serve", "--socket", self.socket,
                    "--host-bytes", str(config.host_bytes), "--disk-path", os.path.join(tmp, "ssd"),
                    "--disk-bytes", str(config.disk_bytes), "--metrics-port", "0"]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.socket)
                return
            except OSError:
                time.sleep(0.05)
            finally:
                s.close()
        raise RuntimeError(f"the daemon did not listen on {self.socket} in {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def sample(self, t: float) -> Sample | None:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

        def kib(name: str) -> int:
            return int(fields.get(name, "0 kB").split()[0])

        return Sample(t, kib("RssAnon"), kib("VmRSS"), int(fields.get("Threads", "0")), fds)

    def log_text(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")
        except OSError:
            return ""

    def lookup_histogram(self) -> dict[float, float]:
        """The daemon's own histogram of lookup handling times (its Prometheus endpoint):
        upper bound in seconds -> lookups that took at most that long, since it started."""
        m = re.search(r"metrics on (http://\S+)", self.log_text())
        if m is None:
            return {}
        try:
            body = urllib.request.urlopen(m.group(1), timeout=10).read().decode()
        except OSError:
            return {}
        out: dict[float, float] = {}
        for line in body.splitlines():
            hit = re.fullmatch(r'kvtier_op_seconds_bucket\{le="([^"]+)",op="lookup"\} (\S+)', line)
            if hit:
                out[float(hit.group(1))] = float(hit.group(2))
        return out

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, arena: str | None = None, timeout: float = 30.0) -> float | None:
        """SIGTERM, and SIGKILL if it has not exited within ``timeout`` (then its ``arena`` is
        removed here, as a restarted daemon would). Seconds it took to exit after SIGTERM."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            if arena and _ARENA.fullmatch(arena):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", arena))
        return time.monotonic() - t0


# -- the run ----------------------------------------------------------------------------------------
def _stop_process(proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def _renice(proc: multiprocessing.process.BaseProcess, nice: int) -> None:
    """Lower a client's priority at once (its imports included)."""
    if nice and proc.pid is not None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, nice)


def _wait_ready(counters: object, rows: Sequence[int], procs: Sequence, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(_Row(counters, r).get("ready") for r in rows):
        for p in procs:
            if p.exitcode is not None:
                raise RuntimeError(f"a benchmark process ({p.name}) exited with {p.exitcode} at start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the benchmark's processes did not start in {timeout:.0f} s")
        time.sleep(0.05)


def _audit(config: DaemonBenchConfig, socket_path: str, counters: object) -> tuple[int, int, int]:
    """Load and check up to ``config.audit`` conversations, spread over all that were created."""
    every = [inst * CONV_STRIDE + k for inst, n in _created(counters, config.max_instances) for k in range(n)]
    if not every or not config.audit:
        return 0, 0, 0
    step = max(1, len(every) // config.audit)
    picked = every[::step][: config.audit]
    convs = Conversations(config, cache=2)
    client = _client(config, socket_path)
    buf, out = _buffers(config)
    tokens = bad = 0
    try:
        for conv in picked:
            _, loaded, wrong, _ = _check(client, convs, conv, convs.get(conv)[0], buf, out)
            tokens += loaded
            bad += wrong
    finally:
        client.close()
    return len(picked), tokens, bad


def _flush(config: DaemonBenchConfig, socket_path: str) -> float | None:
    """Wait for the daemon's queued background work (the storm's prefetches); how long it took,
    None if it did not finish within ``config.flush_s``."""
    from kvtier.server.client import StoreClient

    timeout = max(1, math.ceil(config.flush_s))
    client = StoreClient(socket_path, model=MODEL, layout=config.layout, timeout_s=timeout + 10.0)
    t0 = time.monotonic()
    try:
        return time.monotonic() - t0 if client.flush(timeout=timeout) else None
    finally:
        client.close()


def _stats(client, timeout: float = 30.0) -> dict:  # type: ignore[no-untyped-def]
    """The daemon's snapshot, asking again while it does not answer (up to ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.stats()
        except DaemonUnavailable:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not answer a stats request in {timeout:.0f} s") from None
            time.sleep(0.25)


_LEVEL = re.compile(r" (WARNING|ERROR|CRITICAL) (.*)")
_HEX = re.compile(r"\b[0-9a-f]{16,}\b")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def _warnings(log: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in log.splitlines():
        m = _LEVEL.search(line)
        if m:
            msg = f"{m.group(1)} {_NUMBER.sub('N', _HEX.sub('KEY', m.group(2)))[:200]}"
            counts[msg] = counts.get(msg, 0) + 1
        elif line.startswith("Traceback"):
            counts["Traceback"] = counts.get("Traceback", 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _leaks(stats: dict) -> dict[str, int]:
    """What the daemon still holds: per its leases, and per its DRAM tier itself (pins and
    reservations of no lease would leak slots for good)."""
    host = stats.get("tiers", {}).get("host", {})
    out = {name: int(stats.get(name, 0)) for name in ("pinned_chunks", "writes_in_flight", "orphaned_writes")}
    out["dram_pins"] = int(host.get("pinned", 0))
    out["dram_reservations"] = int(host.get("reserved", 0))
    return out


def run_daemon_bench(config: DaemonBenchConfig | None = None,
                     progress: Callable[[str], None] | None = None) -> DaemonBenchResult:
    """Run the load test (see the module docstring). Raises RuntimeError if the daemon or a
    benchmark process cannot be started or dies; every process it started is stopped and its
    temporary directory removed, whatever happens. The client processes are started with the
    ``spawn`` method: a script calling this needs an ``if __name__ == "__main__":`` guard."""
    config = config or DaemonBenchConfig()
    say = progress or (lambda msg: None)
    ctx = multiprocessing.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="kvtier-bench-daemon-", dir=config.directory)
    try:
        daemon = _Daemon(config, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counters = ctx.RawArray("q", (config.max_instances + 1) * len(COUNTERS))
    stop = ctx.RawValue("b", 0)
    procs: list[multiprocessing.process.BaseProcess] = []
    workers: list[multiprocessing.process.BaseProcess] = []
    instances: list[int] = []
    probe_conn = None
    stats_client = None
    arena = None
    try:
        say("starting the daemon")
        daemon.start()
        stats_client = _client(config, daemon.socket)
        arena = str(_stats(stats_client).get("arena"))

        parent_conn, child_conn = ctx.Pipe()
        probe = ctx.Process(target=_probe, args=(config, daemon.socket, child_conn), name="kvtier-bench-probe")
        probe.start()
        procs.append(probe)
        child_conn.close()
        probe_conn = parent_conn
        if not probe_conn.poll(60):
            raise RuntimeError("the latency probe did not start in 60 s")
        try:
            _, held = probe_conn.recv()
        except EOFError:
            raise RuntimeError(f"the latency probe exited at start ({probe.exitcode}); "
                               "is run_daemon_bench called from an unguarded __main__?") from None
        if not held:
            raise RuntimeError("the daemon did not hold the probe's conversation after saving it")

        def measure(seconds: float) -> None:
            probe_conn.send(("measure", seconds))  # type: ignore[union-attr]

        def measured(seconds: float) -> tuple[array.array, int, int]:
            if not probe_conn.poll(seconds + 60):  # type: ignore[union-attr]
                raise RuntimeError("the latency probe did not answer")
            times = array.array("d")
            try:
                times.frombytes(probe_conn.recv_bytes())  # type: ignore[union-attr]
                errors, short = probe_conn.recv()  # type: ignore[union-attr]
            except EOFError:
                raise RuntimeError(f"the latency probe died ({probe.exitcode})") from None
            return times, errors, short

        say(f"probing lookups on the idle daemon for {config.idle_seconds:g} s")
        measure(config.idle_seconds)
        idle_times, idle_errors, idle_short = measured(config.idle_seconds)

        say("starting the workers and the prefetch storm")
        next_instance = 1

        def start_worker(slot: int | None) -> None:
            nonlocal next_instance
            if next_instance > config.max_instances:
                raise RuntimeError(f"more than {config.max_instances} worker processes were needed")
            inst = next_instance
            next_instance += 1
            p = ctx.Process(target=_worker, args=(config, daemon.socket, inst, counters, stop),
                            name=f"kvtier-bench-worker-{inst}")
            p.start()
            procs.append(p)
            _renice(p, config.client_nice)
            if slot is None:
                workers.append(p)
                instances.append(inst)
            else:
                workers[slot] = p
                instances[slot] = inst

        for _ in range(config.workers):
            start_worker(None)
        storms = []
        if config.storm:
            storms.append(ctx.Process(target=_storm, args=(config, daemon.socket, counters, stop),
                                      name="kvtier-bench-storm"))
            storms[0].start()
            procs.append(storms[0])
            _renice(storms[0], config.client_nice)
        _wait_ready(counters, [*([STORM_ROW] if config.storm else []), *instances], [*storms, *workers], 120)

        storm_text = "a prefetch storm" if config.storm else "no storm"
        say(f"load: {config.workers} workers, {storm_text}, kills every {config.kill_every_s:g} s, "
            f"for {config.seconds:g} s")
        rng = random.Random(_seed(config.seed, 7))
        samples: list[Sample] = []
        killed = restarted = crashes = 0
        start = time.monotonic()
        measure(config.seconds)
        histogram_before = daemon.lookup_histogram()
        end = start + config.seconds
        next_sample, next_kill = start, start + (config.kill_every_s or math.inf)
        while (now := time.monotonic()) < end:
            if now >= next_sample:
                s = daemon.sample(now - start)
                if s is not None:
                    samples.append(s)
                next_sample += 1.0
            if daemon.proc is not None and daemon.proc.poll() is not None:
                raise RuntimeError(f"the daemon died under load ({daemon.proc.returncode}):\n"
                                   f"{daemon.log_tail()}")
            for slot, p in enumerate(workers):
                if p.exitcode is not None:  # exited on its own: a crash
                    crashes += 1
                    start_worker(slot)
            if now >= next_kill:
                slot = rng.randrange(len(workers))
                victim = workers[slot]
                if victim.pid is not None and victim.exitcode is None:
                    os.kill(victim.pid, signal.SIGKILL)
                    victim.join(10)
                    killed += 1
                start_worker(slot)
                restarted += 1
                next_kill += config.kill_every_s
            time.sleep(max(0.0, min(next_sample, next_kill, end) - time.monotonic()))
        stop.value = 1
        histogram_after = daemon.lookup_histogram()
        loaded_times, loaded_errors, loaded_short = measured(0)
        loaded_s = time.monotonic() - start
        last = daemon.sample(loaded_s)
        if last is not None:
            samples.append(last)

        say("stopping the workers")
        for p in [*workers, *storms]:
            _stop_process(p, 15)

        say("auditing stored conversations")
        audit = _audit(config, daemon.socket, counters)

        probe_conn.send(("stop",))
        _stop_process(probe, 15)

        say("waiting for the daemon's background work, pins and reservations to drain")
        flush_s = _flush(config, daemon.socket)
        t0 = time.monotonic()
        settled: float | None = None
        while True:
            stats = _stats(stats_client)
            leaks = _leaks(stats)
            if not sum(leaks.values()) and int(stats.get("clients", 0)) <= 1:  # 1: this one
                settled = time.monotonic() - t0
                break
            if time.monotonic() - t0 > config.settle_s:
                break
            time.sleep(0.1)

        ops = {name: 0 for name in COUNTERS if name != "ready"}
        for r in range(config.max_instances + 1):
            row = _Row(counters, r)
            for name in ops:
                ops[name] += row.get(name)
        tiers: dict = stats.get("tiers", {})  # type: ignore[assignment]
        daemon_stats = {
            "lookups": int(stats.get("lookups", 0)),
            "demotions": int(stats.get("demotions", 0)),
            "promotions": int(stats.get("promotions", 0)),
            "prefetched": int(stats.get("prefetched", 0)),
            "prefetches_dropped": int(stats.get("prefetches_dropped", 0)),
            "load_failures": int(stats.get("load_failures", 0)),
            "engine_load_failures": int(stats.get("engine_load_failures", 0)),
            "saved_chunks": int(stats.get("saved_chunks", 0)),
            "dropped_chunks": int(stats.get("dropped_chunks", 0)),
            "clients_after": int(stats.get("clients", 0)),
        }
        for name, t in tiers.items():
            daemon_stats[f"{name}_chunks"] = int(t["chunks"])
            daemon_stats[f"{name}_evictions"] = int(t["evictions"])
            daemon_stats[f"{name}_bytes_read"] = int(t["io"]["bytes_read"])
            daemon_stats[f"{name}_bytes_written"] = int(t["io"]["bytes_written"])
            daemon_stats[f"{name}_io_errors"] = int(t["io"]["errors"])
        stats_client.close()
        stats_client = None
        stop_s = daemon.stop(arena)
        exit_code = daemon.proc.returncode if daemon.proc is not None else None
        log = daemon.log_text()
        gone = [tuple(map(int, m.groups())) for m in _GONE.finditer(log)]
        return DaemonBenchResult(
            config=config, cpus=os.cpu_count() or 0, loaded_s=loaded_s, ops=ops,
            audit_conversations=audit[0], audit_tokens=audit[1], audit_wrong_tokens=audit[2],
            leaks=leaks, settled_s=settled, flush_s=flush_s, daemon=daemon_stats,
            idle=Latency.of(idle_times), loaded=Latency.of(loaded_times),
            probe_errors=idle_errors + loaded_errors, probe_short_hits=idle_short + loaded_short,
            samples=samples, workers_killed=killed, workers_restarted=restarted, worker_crashes=crashes,
            killed_pins_released=sum(g[0] for g in gone), killed_writes_orphaned=sum(g[1] for g in gone),
            daemon_warnings=_warnings(log),
            daemon_exit_code=exit_code, daemon_stop_s=stop_s,
            arena_removed=not (arena and os.path.exists(os.path.join("/dev/shm", arena))),
            daemon_lookups={le: n - histogram_before.get(le, 0.0) for le, n in histogram_after.items()},
        )
    finally:
        stop.value = 1
        if probe_conn is not None:
            with contextlib.suppress(OSError, ValueError):
                probe_conn.send(("stop",))
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                _stop_process(p, 5)
        if stats_client is not None:
            with contextlib.suppress(DaemonUnavailable, OSError):
                stats_client.close()
        daemon.stop(arena)
        if probe_conn is not None:
            probe_conn.close()
        shutil.rmtree(tmp, ignore_errors=True)
