"""The ``kvtier`` command line. Thin: it parses options, calls into the library, prints.

Layout: ``main`` is the root group; each area gets a subgroup or command registered on it
(``bench`` now; ``demo``, ``serve`` later). A command builds the library's typed config from its
options, turns the library's ``ValueError`` into a click error (non-zero exit, one clear line)
and prints either ``--json`` (one JSON object on stdout) or a rich table.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

import click
from rich.console import Console
from rich.table import Table

from kvtier.bench.io import RATIO_TARGET, STATISTICS, IOBenchConfig, IOBenchResult, run_io_bench
from kvtier.bench.keys import KeysBenchConfig, KeysBenchResult, run_keys_bench


def _version() -> str:
    try:
        return version("kvtier")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


class MiBList(click.ParamType):
    """A comma-separated list of positive whole MiB, e.g. ``1,16``."""

    name = "MIB[,MIB...]"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None
                ) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        try:
            sizes = tuple(int(p) for p in parts)
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of whole MiB (e.g. 1,16)",
                      param, ctx)
        if any(s <= 0 for s in sizes):
            self.fail(f"chunk sizes must be positive, got {value!r}", param, ctx)
        return sizes


def _emit_json(payload: dict[str, object]) -> None:
    click.echo(json.dumps(payload, indent=2))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", prog_name="kvtier")
def main() -> None:
    """kvtier: a tiered KV-cache store (host DRAM, SSD) for LLM inference."""


@main.group()
def bench() -> None:
    """Benchmarks of the tiers and of key bookkeeping."""


@bench.command("io")
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
        _emit_json(result.as_dict())
    else:
        _print_io(result)


@bench.command("remote")
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
        _emit_json(result.as_dict())
        return
    table = Table(title=f"remote tiers vs raw clients (GB/s, median of {rounds}; "
                        f"target ratio >= {RATIO_TARGET})")
    for col in ("backend", "size", "put", "raw put", "ratio", "get", "raw get", "ratio"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for r in result.rows:
        table.add_row(r.backend, f"{r.size_bytes >> 20} MiB", f"{r.put_GBps:.2f}", f"{r.raw_put_GBps:.2f}",
                      f"{r.put_ratio:.2f}", f"{r.get_GBps:.2f}", f"{r.raw_get_GBps:.2f}", f"{r.get_ratio:.2f}")
    Console().print(table)


@bench.command("objects")
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
        _emit_json([r.as_dict() for r in results])
        return
    click.echo(f"recompute seconds saved of {results[0].possible_s:.0f} possible "
               f"({'steady mix' if steady else 'shifting mix'}):")
    click.echo(format_table(results))


@bench.command("truncation")
@click.option("--model", default="small", show_default=True, help="tiny, small, or a model directory.")
@click.option("--context-window", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--system-tokens", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--user-tokens", type=click.IntRange(min=1), default=None,
              help="Each earlier question [default: 3/16 of the window].")
@click.option("--reply-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="The question that overflows the window.")
@click.option("--steps", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens generated and compared.")
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Conversations.")
@click.option("--timings", type=click.IntRange(min=1), default=5, show_default=True,
              help="TTFT measurements per way and conversation (median kept).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def bench_truncation(model: str, context_window: int, system_tokens: int, user_tokens: int | None,
                     reply_tokens: int, new_tokens: int, steps: int, chunk_tokens: int,
                     repeats: int, timings: int, seed: int, as_json: bool) -> None:
    """Conversations past the context window: TTFT with re-used, RoPE-shifted KV against a
    full recompute of the truncated context, and how closely their outputs agree."""
    from kvtier.bench.truncation import TruncationBenchConfig, format_table, run

    try:
        config = TruncationBenchConfig(
            model=model, context_window=context_window, system_tokens=system_tokens,
            user_tokens=user_tokens, reply_tokens=reply_tokens, new_tokens=new_tokens,
            steps=steps, chunk_tokens=chunk_tokens, repeats=repeats, timings=timings, seed=seed)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    result = run(config)
    if as_json:
        _emit_json(result.as_dict())
    else:
        click.echo(format_table(result))


@bench.command("keys")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--repeats", type=click.IntRange(min=1), default=50, show_default=True)
def bench_keys(as_json: bool, repeats: int) -> None:
    """Chunking + hashing + index lookup of a 128K-token prompt."""
    result = run_keys_bench(KeysBenchConfig(repeats=repeats))
    if as_json:
        _emit_json(result.as_dict())
    else:
        _print_keys(result)


@main.command()
@click.option("--model", default="small", show_default=True,
              help="Embedded default model size (tiny, small) or a local model directory.")
@click.option("--users", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds; each user sends a question and a follow-up per round.")
@click.option("--doc-chars", type=click.IntRange(min=0), default=2500, show_default=True,
              help="Length of the document each user opens with.")
@click.option("--user-chars", type=click.IntRange(min=1), default=250, show_default=True,
              help="Length of a question (follow-ups are a third of it).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--host-fraction", type=click.FloatRange(min=0, min_open=True), default=0.35,
              show_default=True, help="DRAM tier size as a share of all final histories' KV.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Parent of the SSD tier's temporary directory.")
@click.option("--engine", type=click.Choice(["transformers", "vllm"]), default="transformers",
              show_default=True, help="Run the chats through kvtier's transformers adapter or vLLM.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of turns.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Draw TTFT against turn, kvtier and full recompute, to this PNG.")
def demo(model: str, users: int, rounds: int, doc_chars: int, user_chars: int, max_new_tokens: int,
         host_fraction: float, directory: str | None, engine: str, as_json: bool,
         plot_path: str | None) -> None:
    """Multi-turn chats timed with kvtier and with full recompute."""
    from rich.progress import Progress

    from kvtier.demo import DemoConfig, plot, run_demo, summarize

    try:
        config = DemoConfig(model=model, users=users, rounds=rounds, doc_chars=doc_chars,
                            user_chars=user_chars,
                            max_new_tokens=max_new_tokens, host_fraction=host_fraction,
                            directory=directory, engine=engine)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("turns", total=None)

        def on_turn(rec, total):  # type: ignore[no-untyped-def]
            progress.update(task, total=total, advance=1)
            if not as_json:
                progress.console.print(
                    f"user {rec.user} turn {rec.turn}: history {rec.history_tokens:>5} tokens, "
                    f"hit {rec.hit_tokens:>5} ({rec.tier:>9}), TTFT {rec.ttft_kvtier_s:6.3f} s "
                    f"vs {rec.ttft_recompute_s:6.3f} s recompute"
                    + ("" if rec.same_tokens else "  [red]OUTPUT DIFFERS[/]")
                )

        try:
            records = run_demo(config, on_turn)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    if plot_path:
        plot(records, plot_path)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in records], indent=2))
        return
    _print_demo(records, summarize(records))
    if plot_path:
        console.print(f"plot written to {plot_path}")


@bench.command("vllm-ttft")
@click.option("--model", default="small", show_default=True,
              help="Embedded default model size (tiny, small) or a local model directory.")
@click.option("--history", "history_tokens", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_vllm_ttft(model: str, history_tokens: int, new_tokens: int, repeats: int, as_json: bool) -> None:
    """TTFT through vLLM: vLLM alone vs vLLM + kvtier from DRAM vs from SSD."""
    from kvtier.bench.vllm_ttft import VLLMTTFTConfig, run_vllm_ttft

    try:
        config = VLLMTTFTConfig(model=model, history_tokens=history_tokens, new_tokens=new_tokens,
                                repeats=repeats)
        result = run_vllm_ttft(config)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        _emit_json(result.as_dict())
        return
    table = Table(title=f"vLLM TTFT, {new_tokens} new tokens after a {history_tokens}-token history")
    for col in ("vLLM alone s", "kvtier DRAM s", "ratio", "kvtier SSD s", "ratio", "same output"):
        table.add_column(col, justify="right")
    table.add_row(f"{result.ttft_vllm_s:.3f}", f"{result.ttft_dram_s:.3f}", f"{result.dram_ratio:.3f}",
                  f"{result.ttft_ssd_s:.3f}", f"{result.ssd_ratio:.3f}",
                  "yes" if result.same_output else "[red]NO[/]")
    Console().print(table)


@bench.command("ttft")
@click.option("--model", default="small", show_default=True,
              help="Embedded default model size (tiny, small) or a local model directory.")
@click.option("--histories", type=MiBList(), default="1024,2048,4096,8192", show_default=True,
              help="History lengths in tokens, comma-separated.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="New tokens of the turn that continues each history.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Parent of the SSD tier's temporary directory.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of rows.")
def bench_ttft(model: str, histories: tuple[int, ...], new_tokens: int, repeats: int,
               directory: str | None, as_json: bool) -> None:
    """Time to first token by history length: full recompute vs DRAM hit vs SSD hit."""
    from kvtier.bench.ttft import TTFTBenchConfig, run_ttft_bench

    try:
        config = TTFTBenchConfig(model=model, histories=histories, new_tokens=new_tokens,
                                 repeats=repeats, directory=directory)
        with Console(stderr=True).status("timing prefills..."):
            rows = run_ttft_bench(config)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    table = Table(title=f"time to first token, {new_tokens} new tokens after a cached history")
    for col in ("history", "recompute s", "DRAM hit s", "ratio", "SSD hit s", "ratio",
                "load hidden (DRAM/SSD)", "same output", "max logit diff"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.history_tokens), f"{r.ttft_recompute_s:.3f}", f"{r.ttft_host_s:.3f}",
                      f"{r.host_ratio:.3f}", f"{r.ttft_disk_s:.3f}", f"{r.disk_ratio:.3f}",
                      f"{r.load_hidden_host:.0%} / {r.load_hidden_disk:.0%}",
                      "yes" if r.same_output else "[red]NO[/]", f"{r.max_logit_diff:.1e}")
    Console().print(table)


@main.group()
def store() -> None:
    """The store daemon: one cache shared by several processes (vLLM instances, workers)."""


@store.command("serve")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config file; flags override it.")
@click.option("--socket", "socket_path", default=None, help="Unix socket to serve on.")
@click.option("--model", default=None, help="Weights fingerprint (part of every key).")
@click.option("--model-dir", default=None, type=click.Path(file_okay=False),
              help="Derive fingerprint and KV layout from a local model directory.")
@click.option("--host-bytes", type=click.IntRange(min=1), default=None, help="DRAM tier size.")
@click.option("--disk-path", default=None, help="SSD tier directory.")
@click.option("--disk-bytes", type=click.IntRange(min=1), default=None, help="SSD tier size.")
@click.option("--write-through/--no-write-through", default=None,
              help="Write every saved chunk to SSD at once.")
@click.option("--metrics-port", type=click.IntRange(min=0), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT.")
def store_serve(config_path: str | None, socket_path: str | None, model: str | None,
                model_dir: str | None, host_bytes: int | None, disk_path: str | None,
                disk_bytes: int | None, write_through: bool | None, metrics_port: int | None) -> None:
    """Run the store daemon until interrupted."""
    import logging
    import signal

    from kvtier.server.config import daemon_config, read_toml
    from kvtier.server.daemon import StoreDaemon

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        raw: dict[str, object] = read_toml(config_path) if config_path else {}
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    flags = {"socket": socket_path, "model": model, "model_dir": model_dir,
             "write_through": write_through, "metrics_port": metrics_port}
    raw.update({k: v for k, v in flags.items() if v is not None})
    if host_bytes is not None:
        raw["host"] = {**dict(raw.get("host") or {}), "capacity_bytes": host_bytes}  # type: ignore[call-overload]
    if disk_path is not None or disk_bytes is not None:
        raw["disk"] = {**dict(raw.get("disk") or {}),  # type: ignore[call-overload]
                       **({"path": disk_path} if disk_path else {}),
                       **({"capacity_bytes": disk_bytes} if disk_bytes else {})}
    try:
        daemon = StoreDaemon(daemon_config(raw))
    except (ValueError, TypeError) as exc:
        raise click.ClickException(str(exc)) from exc

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    where = f"; metrics on http://{daemon.metrics_address[0]}:{daemon.metrics_address[1]}/metrics" \
        if daemon.metrics_address else ""
    click.echo(f"kvtier store serving {daemon.config.socket_path}{where}", err=True)
    try:
        daemon.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        daemon.stop()


@store.command("stats")
@click.option("--socket", "socket_path", required=True, help="The daemon's Unix socket.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw snapshot as JSON.")
def store_stats(socket_path: str, as_json: bool) -> None:
    """Capacity, use, hits and misses per tier of a running daemon."""
    from kvtier.server.client import DaemonUnavailable, StoreClient

    client = StoreClient(socket_path)
    try:
        snap = client.stats()
    except DaemonUnavailable as exc:
        raise click.ClickException(f"no kvtier daemon at {socket_path}: {exc}") from exc
    finally:
        client.close()
    if as_json:
        _emit_json(snap)
        return
    table = Table(title=f"kvtier store at {socket_path}")
    for col in ("tier", "capacity", "used", "chunks", "hits", "misses", "hit ratio", "evictions",
                "read", "written", "errors"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in snap["tiers"].items():  # type: ignore[union-attr]
        hits, misses = t["hits"], t["misses"]
        table.add_row(name, _size(t["capacity_bytes"]), _size(t["used_bytes"]), str(t["chunks"]),
                      str(hits), str(misses), f"{hits / (hits + misses):.1%}" if hits + misses else "-",
                      str(t["evictions"]), _size(t["io"]["bytes_read"]),
                      _size(t["io"]["bytes_written"]), str(t["io"]["errors"]))
    console = Console()
    console.print(table)
    console.print(f"clients {snap['clients']}, pinned chunks {snap['pinned_chunks']}, "
                  f"promotions {snap['promotions']}, demotions {snap['demotions']}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


# -- replay (issue 5): trace replay of placement policies, and the workload generator ---------
_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


class ByteSize(click.ParamType):
    """A byte count such as ``64GiB``, ``1.5TB`` or ``1048576``."""

    name = "BYTES"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None
                ) -> int:
        if isinstance(value, int):
            return value
        import re

        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _BYTE_UNITS:
            self.fail(f"{value!r} is not a size like 64GiB, 500GB or 1048576", param, ctx)
        return int(float(m.group(1)) * _BYTE_UNITS[unit])


def _blocks(blocks: int | None, nbytes: int | None, chunk_bytes: int, name: str) -> int | None:
    if blocks is not None and nbytes is not None:
        raise click.UsageError(f"give --{name}-blocks or --{name}-bytes, not both")
    return nbytes // chunk_bytes if nbytes is not None else blocks


@main.command("replay")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.argument("more_policies", nargs=-1, metavar="")
@click.option("--policy", "policies", multiple=True, default=("lru",), show_default=True,
              help="Policy name(s): --policy lru cost optimal, or repeat --policy, or a,b,c.")
@click.option("--dram-blocks", type=click.IntRange(min=1), default=None,
              help="DRAM capacity in 512-token blocks [default: 10% of the trace's unique blocks].")
@click.option("--ssd-blocks", type=click.IntRange(min=0), default=None,
              help="SSD capacity in blocks; 0 (default): no SSD.")
@click.option("--dram-bytes", type=ByteSize(), default=None, help="DRAM capacity in bytes (e.g. 64GiB).")
@click.option("--ssd-bytes", type=ByteSize(), default=None, help="SSD capacity in bytes (e.g. 2TB).")
@click.option("--layers", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--head-dim", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True, help="KV element type.")
@click.option("--hidden", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Attention width (query heads x head dim).")
@click.option("--params", type=click.FloatRange(min=0, min_open=True), default=8e9,
              show_default=True, help="Weights per token (non-embedding parameters).")
@click.option("--tflops", type=click.FloatRange(min=0, min_open=True), default=400.0,
              show_default=True, help="Sustained prefill TFLOP/s of one instance.")
@click.option("--dram-gbps", type=click.FloatRange(min=0, min_open=True), default=20.0,
              show_default=True, help="DRAM -> accelerator read bandwidth, GB/s.")
@click.option("--ssd-gbps", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, help="SSD read bandwidth, GB/s.")
@click.option("--instances", type=click.IntRange(min=1), default=4, show_default=True,
              help="Prefill instances serving the queue.")
@click.option("--sweep", is_flag=True,
              help="Sweep DRAM capacity over --fractions of the trace's unique blocks.")
@click.option("--fractions", default="0.01,0.02,0.05,0.1,0.2,0.3,0.5", show_default=True,
              help="DRAM capacities of --sweep, as fractions of the unique blocks.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per run.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Draw hit ratio against DRAM capacity, one line per policy, to this PNG.")
def replay_cmd(trace: str, more_policies: tuple[str, ...], policies: tuple[str, ...],
               dram_blocks: int | None, ssd_blocks: int | None, dram_bytes: int | None,
               ssd_bytes: int | None, layers: int, kv_heads: int, head_dim: int, dtype: str,
               hidden: int, params: float, tflops: float, dram_gbps: float, ssd_gbps: float,
               instances: int, sweep: bool, fractions: str, as_json: bool,
               plot_path: str | None) -> None:
    """Replay a Mooncake-format TRACE through placement policies over DRAM (+ SSD)."""
    from kvtier.bench.replay import ReplayConfig, replay
    from kvtier.bench.replay import plot as plot_replay
    from kvtier.bench.replay import sweep as sweep_replay
    from kvtier.bench.trace import TraceError, load_trace
    from kvtier.core.cost_model import ComputeModel
    from kvtier.core.layout import KVLayout

    names = [n.strip() for p in (*policies, *more_policies) for n in p.split(",") if n.strip()]
    try:
        layout = KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                          chunk_tokens=512)
        compute = ComputeModel(num_layers=layers, hidden=hidden, params=params,
                               flops=tflops * 1e12)
        fracs = tuple(float(f) for f in fractions.split(","))
        dram = _blocks(dram_blocks, dram_bytes, layout.chunk_bytes, "dram")
        ssd = _blocks(ssd_blocks, ssd_bytes, layout.chunk_bytes, "ssd") or 0
        tr = load_trace(trace)
        if dram is None:
            dram = max(1, tr.unique_blocks // 10)
        configs = [ReplayConfig(policy=n, dram_blocks=dram, ssd_blocks=ssd, layout=layout,
                                dram_read_GBps=dram_gbps, ssd_read_GBps=ssd_gbps,
                                compute=compute, instances=instances) for n in names]
        if sweep:
            results = sweep_replay(tr, configs[0], names, fracs)
        else:
            results = [replay(tr, cfg) for cfg in configs]
    except TraceError as exc:
        raise click.ClickException(str(exc)) from exc
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if plot_path:
        plot_replay(results, tr.unique_blocks, plot_path)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in results], indent=2))
        return
    table = Table(title=f"replay of {trace}: {len(tr.requests)} requests, "
                        f"{tr.unique_blocks} unique blocks")
    for col in ("policy", "DRAM blk", "SSD blk", "hit blk", "hit tok", "DRAM", "SSD",
                "prefill saved", "TTFT mean s", "p50 s", "p99 s", "SSD wr", "SSD rd", "prefetch acc"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        table.add_row(r.policy, str(r.dram_blocks), str(r.ssd_blocks), f"{r.hit_ratio_blocks:.1%}",
                      f"{r.hit_ratio_tokens:.1%}", f"{r.hit_ratio_dram:.1%}", f"{r.hit_ratio_ssd:.1%}",
                      f"{r.prefill_saved:.1%}", f"{r.ttft_mean_s:.3f}", f"{r.ttft_p50_s:.3f}",
                      f"{r.ttft_p99_s:.3f}", f"{r.ssd_bytes_written / 1e9:.0f} GB",
                      f"{r.ssd_bytes_read / 1e9:.0f} GB",
                      "-" if r.prefetch_accuracy is None else f"{r.prefetch_accuracy:.1%}")
    Console().print(table)
    if plot_path:
        Console(stderr=True).print(f"plot written to {plot_path}")


@bench.command("workload")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--requests", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--session-rate", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="New sessions per second.")
@click.option("--turns", type=click.FloatRange(min=1), default=6.0, show_default=True,
              help="Mean turns per session.")
@click.option("--think-s", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="Mean think time between turns, seconds.")
@click.option("--system-prompts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--system-tokens", type=click.IntRange(min=0), default=2048, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def bench_workload(out: str, requests: int, session_rate: float, turns: float, think_s: float,
                   system_prompts: int, system_tokens: int, seed: int) -> None:
    """Write a ShareGPT-like multi-turn trace in Mooncake format to OUT."""
    from kvtier.bench.workload import WorkloadConfig, generate

    try:
        config = WorkloadConfig(requests=requests, session_rate=session_rate, turns_mean=turns,
                                think_mean_s=think_s, system_prompts=system_prompts,
                                system_tokens=system_tokens, seed=seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    with open(out, "w", encoding="utf-8") as f:
        written = generate(config, f)
    click.echo(f"{written} requests written to {out}", err=True)


# -- human output ------------------------------------------------------------------------------
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


def _print_demo(records, summary) -> None:  # type: ignore[no-untyped-def]
    table = Table(title="kvtier demo: time to first token per turn")
    for col in ("user", "turn", "history", "hit", "tier", "kvtier s", "recompute s", "ratio",
                "same output"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r.user), str(r.turn), str(r.history_tokens), str(r.hit_tokens), r.tier,
                      f"{r.ttft_kvtier_s:.3f}", f"{r.ttft_recompute_s:.3f}",
                      f"{r.ttft_kvtier_s / r.ttft_recompute_s:.2f}",
                      "yes" if r.same_tokens else "[red]NO[/]")
    console = Console()
    console.print(table)
    summ = Table(title="turns with history >= 4096 tokens, by tier of the hit")
    for col in ("tier", "turns", "kvtier s", "recompute s", "ratio", "load hidden"):
        summ.add_column(col, justify="right")
    for tier, row in summary.items():
        summ.add_row(tier, str(row["turns"]), f"{row['ttft_kvtier_s']:.3f}",
                     f"{row['ttft_recompute_s']:.3f}", f"{row['ratio']:.3f}",
                     f"{row['load_hidden']:.0%}")
    console.print(summ)


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


if __name__ == "__main__":  # pragma: no cover
    main()
