"""``kvtier bench daemon``: the load test of a real store daemon, and its report."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.common import ByteSize, _run_with_status, emit_json

if TYPE_CHECKING:
    from kvtier.bench.daemon_report import DaemonBenchResult


@click.command("daemon")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Length of the loaded phase.")
@click.option("--workers", type=click.IntRange(min=1, max=64), default=3, show_default=True,
              help="Client processes looping lookup / load / verify / save.")
@click.option("--dram-chunks", type=click.IntRange(min=1), default=48, show_default=True,
              help="The daemon's DRAM, in 16 KiB chunks (small: eviction to SSD runs all the time).")
@click.option("--disk-bytes", type=ByteSize(), default="512MiB", show_default=True,
              help="The daemon's SSD tier (smaller than what the run saves: SSD eviction runs too).")
@click.option("--kill-every", "kill_every_s", type=click.FloatRange(min=0), default=20.0,
              show_default=True, help="SIGKILL a worker (and start another) this often, seconds; 0: never.")
@click.option("--idle-seconds", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Probe lookups on the idle daemon first, this long.")
@click.option("--storm/--no-storm", default=True, show_default=True,
              help="Run the prefetch storm (off: workers alone, for comparison).")
@click.option("--storm-rate", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Prefetch requests a second of the storm; 0: as fast as it can.")
@click.option("--think-ms", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="A worker sleeps this long after each step (an engine computing).")
@click.option("--client-nice", type=click.IntRange(min=0, max=19), default=0, show_default=True,
              help="Niceness of the workers and the storm (the daemon and the probe keep 0): on a "
                   "machine with fewer cores than busy processes, keeps the probe from measuring "
                   "the CPU scheduler.")
@click.option("--probe-interval-ms", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="The latency probe starts a lookup this often.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Parent of the temporary directory (socket, SSD tier). Default: $TMPDIR or /tmp.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def bench_daemon(seconds: float, workers: int, dram_chunks: int, disk_bytes: int, kill_every_s: float,
                 idle_seconds: float, storm: bool, storm_rate: float, think_ms: float,
                 client_nice: int, probe_interval_ms: float,
                 directory: str | None, seed: int, as_json: bool) -> None:
    """Load test of a real store daemon: worker processes (some SIGKILLed) checking every byte
    they load, a prefetch storm from SSD, lookup latency idle and under load, leaks, memory."""
    from kvtier.bench.daemon_config import DaemonBenchConfig
    from kvtier.bench.daemon_load import run_daemon_bench

    try:
        config = DaemonBenchConfig(seconds=seconds, workers=workers, dram_chunks=dram_chunks,
                                   disk_bytes=disk_bytes,
                                   kill_every_s=kill_every_s, idle_seconds=idle_seconds,
                                   storm=storm, storm_rate=storm_rate, think_ms=think_ms,
                                   client_nice=client_nice,
                                   probe_interval_ms=probe_interval_ms, directory=directory, seed=seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        result = _run_with_status(run_daemon_bench, config, "load test of the store daemon", quiet=as_json)
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        emit_json(result.as_dict())
    else:
        _print_daemon(result)


# -- human output --------------------------------------------------------------
def _print_daemon(result: DaemonBenchResult) -> None:
    data = result.as_dict()
    cfg, ops, lat, mem = result.config, result.ops, data["latency"], data["memory"]
    console = Console()

    def good(ok: bool, text: str) -> str:
        return f"[{'green' if ok else 'red'}]{text}[/]"

    table = Table(title=f"lookup latency of a held {cfg.probe_tokens}-token conversation (ms; "
                        f"target p99 < {lat['target_p99_ms']:g} under load)")
    for col in ("daemon", "lookups", "p50", "p99", "max", "mean"):
        table.add_column(col, justify="left" if col == "daemon" else "right")
    loaded = "under load + storm" if cfg.storm else "under load (no storm)"
    for name, lt in (("idle", result.idle), (loaded, result.loaded)):
        p99 = f"{lt.p99_ms:.3f}"
        if lt is result.loaded:
            p99 = good(result.meets_target, p99)
        table.add_row(name, str(lt.count), f"{lt.p50_ms:.3f}", p99, f"{lt.max_ms:.3f}", f"{lt.mean_ms:.3f}")
    table.add_row("ratio", "", f"{lat['p50_ratio']:.2f}", f"{lat['p99_ratio']:.2f}", "", "")
    console.print(table)
    side = lat.get("daemon_side") or {}
    if side:
        console.print(f"the daemon's own handling of every client's lookups under load (its histogram): "
                      f"{side['lookups']} lookups, {side['within_1ms']:.2%} within 1 ms, "
                      f"{side['within_2ms']:.2%} within 2 ms, p99 at most {side['p99_at_most_ms']:g} ms")

    checks = Table(title="invariants")
    checks.add_column("check")
    checks.add_column("value", justify="right")
    checks.add_row("tokens verified (workers + audit)", str(data["verified_tokens"]))
    checks.add_row("tokens loaded of those the workers' lookups promised",
                   f"{ops['verified_tokens']} of {ops['hit_tokens']} ({ops['short_loads']} short loads)")
    checks.add_row("wrong tokens", good(result.wrong_tokens == 0, str(result.wrong_tokens)))
    for name, value in result.leaks.items():
        checks.add_row(f"leaked {name.replace('_', ' ')}", good(value == 0, str(value)))
    settled = "never" if result.settled_s is None else f"{result.settled_s:.1f} s"
    flushed = "never" if result.flush_s is None else f"{result.flush_s:.1f} s"
    checks.add_row("background work (queued prefetches) done after the run in", flushed)
    checks.add_row("pins and reservations drained after that in", good(result.settled_s is not None, settled))
    if mem:
        checks.add_row("daemon RssAnon start / end / max (KiB)",
                       f"{mem['rss_anon_kib_start']} / {mem['rss_anon_kib_end']} / {mem['rss_anon_kib_max']}")
        checks.add_row("daemon RssAnon growth (whole / second half)",
                       f"{mem['rss_anon_growth_pct']:+.1f}% / {mem['rss_anon_growth_second_half_pct']:+.1f}%")
        checks.add_row("daemon threads / fds start -> end",
                       f"{mem['threads_start']} -> {mem['threads_end']} / {mem['fds_start']} -> {mem['fds_end']}")
    in_dram = result.daemon.get("host_chunks", 0)
    checks.add_row("chunks the daemon's index places in DRAM (DRAM holds)",
                   good(in_dram <= cfg.dram_chunks, f"{in_dram} ({cfg.dram_chunks})"))
    console.print(checks)

    d = result.daemon
    console.print(
        f"{result.loaded_s:.0f} s loaded, {cfg.workers} workers on {result.cpus} CPUs, DRAM "
        f"{cfg.dram_chunks} chunks of {cfg.layout.chunk_bytes >> 10} KiB; "
        f"steps {ops['steps']}: lookups {ops['lookups']}, loads {ops['loads']} "
        f"(short {ops['short_loads']}), saves {ops['saves']} (stored {ops['stored_chunks']}, present "
        f"{ops['present_chunks']}, busy {ops['busy_chunks']}, dropped {ops['dropped_chunks']}), "
        f"revisits {ops['revisits']}, prefetches {ops['prefetches']}, conversations {ops['conversations']}")
    console.print(
        f"daemon: demotions {d['demotions']}, promotions {d['promotions']}, prefetched {d['prefetched']} "
        f"(hints dropped {d['prefetches_dropped']}), "
        f"evictions host {d.get('host_evictions', 0)} disk {d.get('disk_evictions', 0)}, "
        f"load failures {d['load_failures']}, lookups {d['lookups']}; chunks on SSD at the end "
        f"{d.get('disk_chunks', 0)}")
    console.print(
        f"workers killed {result.workers_killed}, restarted {result.workers_restarted}, crashed "
        f"{result.worker_crashes}; the daemon released {result.killed_pins_released} pins and orphaned "
        f"{result.killed_writes_orphaned} reservations of dead clients; client errors {ops['errors']}, "
        f"lost leases {ops['lost_leases']}, probe errors {result.probe_errors}, probe short hits "
        f"{result.probe_short_hits}; daemon exit {result.daemon_exit_code}"
        + (f" after {result.daemon_stop_s:.1f} s" if result.daemon_stop_s is not None else "")
        + ("" if result.arena_removed else " [red](its arena is left in /dev/shm)[/]"))
    for msg, n in list(result.daemon_warnings.items())[:8]:
        console.print(f"[yellow]daemon log, {n} x:[/] {msg}", markup=True, highlight=False)
