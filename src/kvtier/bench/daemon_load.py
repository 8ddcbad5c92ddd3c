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
under load (the target is p99 < :data:`~kvtier.bench.daemon_report.P99_TARGET_MS` under load), RssAnon start/end/max, workers
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
import tempfile
import time
from collections.abc import Callable, Sequence

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
from kvtier.bench.daemon_config import DaemonBenchConfig
from kvtier.bench.daemon_process import _Daemon, _warnings
from kvtier.bench.daemon_report import DaemonBenchResult, Latency, Sample
from kvtier.errors import DaemonUnavailable

_GONE = re.compile(r"gone: released (\d+) pins, orphaned (\d+) reservations")


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
