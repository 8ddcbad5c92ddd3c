"""``kvtier bench io``, ``keys``, ``remote`` and ``objects``: the store without a model -- the
tiers' throughput against raw baselines, key bookkeeping, the remote tiers against their
backends' clients, and kinds of objects sharing one DRAM budget."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from kvtier.bench.io import RATIO_TARGET, STATISTICS, IOBenchConfig, IOBenchResult, run_io_bench
from kvtier.bench.keys import KeysBenchConfig, KeysBenchResult, run_keys_bench
from kvtier.cli.common import MiBList, emit_json


@click.command("io")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Parent of the disk benchmark's temporary directory (must be a real disk, "
                   "not tmpfs). Default: $TMPDIR or /tmp.")
@click.option("--sizes", type=MiBList(), default="1,16", show_default=True,
              help="Chunk sizes in MiB.")
@click.option("--total-mib", type=click.IntRange(min=1), default=256, show_default=True,
              help="MiB moved per phase and chunk size.")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed rounds (after one warm-up), tier and baseline alternating.")
@click.option("--statistic", type=click.Choice(sorted(STATISTICS)), default="median",
              show_default=True, help="How the rounds' times are combined.")
@click.option("--fsync/--no-fsync", default=False, show_default=True,
              help="fsync every chunk file (tier and baseline alike).")
def bench_io(as_json: bool, directory: str | None, sizes: tuple[int, ...], total_mib: int,
             rounds: int, statistic: str, fsync: bool) -> None:
    """Write/read throughput of the host and disk tiers against raw baselines."""
    try:
        config = IOBenchConfig(sizes_mib=sizes, total_mib=total_mib, rounds=rounds,
                               directory=directory, fsync=fsync, statistic=statistic)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        if as_json:
            result = run_io_bench(config)
        else:
            with Console(stderr=True).status("measuring tier and baseline I/O..."):
                result = run_io_bench(config)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        emit_json(result.as_dict())
    else:
        _print_io(result)


@click.command("keys")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--repeats", type=click.IntRange(min=1), default=50, show_default=True)
def bench_keys(as_json: bool, repeats: int) -> None:
    """Chunking + hashing + index lookup of a 128K-token prompt."""
    result = run_keys_bench(KeysBenchConfig(repeats=repeats))
    if as_json:
        emit_json(result.as_dict())
    else:
        _print_keys(result)


@click.command("remote")
@click.option("--backend", type=click.Choice(["valkey", "mooncake", "all"]), default="all",
              show_default=True, help="Which remote tier to measure.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--sizes", type=MiBList(), default="1,16", show_default=True,
              help="Object sizes in MiB.")
@click.option("--count", type=click.IntRange(min=1), default=8, show_default=True,
              help="Objects moved per phase and size.")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed rounds (after one warm-up); the median is reported.")
def bench_remote(backend: str, as_json: bool, sizes: tuple[int, ...], count: int, rounds: int) -> None:
    """Put/get throughput of the remote tiers against their backend's own client, on loopback
    servers this command starts and stops."""
    from kvtier.bench.remote import BACKENDS, RATIO_TARGET, RemoteBenchConfig, run_remote_bench

    config = RemoteBenchConfig(backends=BACKENDS if backend == "all" else (backend,),
                               sizes=tuple(s << 20 for s in sizes), count=count, rounds=rounds)
    result = run_remote_bench(config)
    if as_json:
        emit_json(result.as_dict())
        return
    table = Table(title=f"remote tiers vs raw clients (GB/s, median of {rounds}; "
                        f"target ratio >= {RATIO_TARGET})")
    for col in ("backend", "size", "per call", "put", "raw put", "ratio", "get", "raw get", "ratio"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for r in result.rows:
        calls = "1" if r.mode == "each" else str(count)  # objects per call
        table.add_row(r.backend, f"{r.size_bytes >> 20} MiB", calls, f"{r.put_GBps:.2f}", f"{r.raw_put_GBps:.2f}",
                      f"{r.put_ratio:.2f}", f"{r.get_GBps:.2f}", f"{r.raw_get_GBps:.2f}", f"{r.get_ratio:.2f}")
    Console().print(table)


@click.command("objects")
@click.option("--requests", type=click.IntRange(min=1), default=4000, show_default=True,
              help="Turns of the session workload.")
@click.option("--budgets", default="0.05,0.1,0.2", show_default=True,
              help="DRAM budgets as fractions of all distinct slots.")
@click.option("--steady", is_flag=True, help="A steady mix of kinds instead of shifting phases.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per budget.")
def bench_objects(requests: int, budgets: str, steady: bool, as_json: bool) -> None:
    """KV chunks, encoder outputs and index shards under one DRAM budget: recompute time
    saved by `cost` and `lru` against the best fixed per-kind partition."""
    from kvtier.bench.objects import ObjectsBenchConfig, format_table, run

    try:
        fractions = tuple(float(b) for b in budgets.split(","))
        kw = {"phases": ((1.0, 1.0),)} if steady else {}
        config = ObjectsBenchConfig(requests=requests, budgets=fractions, **kw)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    results = run(config)
    if as_json:
        emit_json([r.as_dict() for r in results])
        return
    click.echo(f"recompute seconds saved of {results[0].possible_s:.0f} possible "
               f"({'steady mix' if steady else 'shifting mix'}):")
    click.echo(format_table(results))


# -- human output --------------------------------------------------------------
def _ratio(value: float, target: float = RATIO_TARGET) -> str:
    return f"[{'green' if value >= target else 'red'}]{value:.2f}[/]"


def _print_io(result: IOBenchResult) -> None:
    table = Table(title="kvtier I/O throughput (GB/s, 1e9 bytes/s)")
    for col in ("tier", "chunk", "write", "baseline", "ratio", "read", "baseline", "ratio"):
        table.add_column(col, justify="left" if col in ("tier", "chunk") else "right")
    for name, tier in (("host", result.host), ("disk", result.disk)):
        rows = [(s.label, s.throughput) for s in tier.by_size] + [("all", tier.throughput)]
        for label, t in rows:
            table.add_row(
                name, label,
                f"{t.write_GBps:.2f}", f"{t.baseline_write_GBps:.2f}", _ratio(t.write_ratio),
                f"{t.read_GBps:.2f}", f"{t.baseline_read_GBps:.2f}", _ratio(t.read_ratio),
            )
        table.add_section()
    console = Console()
    console.print(table)
    cfg = result.config
    console.print(
        f"disk: {result.directory} ({result.fs_type}), "
        f"O_DIRECT={'on' if result.direct_io else 'off'}, fsync={'on' if cfg.fsync else 'off'}; "
        f"{cfg.rounds} rounds, {cfg.statistic}; 'all' = total bytes / total time; "
        f"target ratio >= {RATIO_TARGET}; load {result.load_avg_1m:.2f}"
    )
    if result.fs_type in ("tmpfs", "ramfs"):
        console.print("[yellow]warning: the disk benchmark ran on a RAM filesystem; use --dir[/]")


def _print_keys(result: KeysBenchResult) -> None:
    cfg = result.config
    table = Table(title=f"chunk + hash + lookup of {cfg.num_tokens} tokens "
                        f"({result.num_chunks} chunks of {cfg.chunk_tokens}), ms")
    target = f"target < {result.target_ms:g}"
    for col in ("input", "median", "best", "chunk+hash", "lookup", target):
        table.add_column(col, justify="left" if col == "input" else "right")
    for r in (result.list_input, result.array_input):
        ok = r.median_ms < result.target_ms
        table.add_row(r.input, f"{r.median_ms:.2f}", f"{r.best_ms:.2f}", f"{r.chunk_median_ms:.2f}",
                      f"{r.lookup_median_ms:.3f}", "[green]yes[/]" if ok else "[red]no[/]")
    Console().print(table)
