"""``kvtier replay``: placement policies replayed on a request trace."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.common import ByteSize


def _blocks(blocks: int | None, nbytes: int | None, chunk_bytes: int, name: str) -> int | None:
    if blocks is not None and nbytes is not None:
        raise click.UsageError(f"give --{name}-blocks or --{name}-bytes, not both")
    return nbytes // chunk_bytes if nbytes is not None else blocks


def _codec_figures(codec: str, layout: object, decode_gbps: float | None) -> tuple[float, float]:
    """(stored/raw ratio, decode GB/s) of ``codec`` for one layer of one block of ``layout``."""
    import math

    if codec == "none":
        return 1.0, math.inf
    from kvtier.tiers.codec_types import KVFormat
    from kvtier.tiers.codecs import frame_bytes, measure

    fmt = KVFormat.of_layout(layout)
    if fmt is None:
        raise click.UsageError(f"--ssd-codec {codec}: no codec reads {layout.dtype} KV")  # type: ignore[attr-defined]
    seg = layout.layer_bytes  # type: ignore[attr-defined]
    ratio = frame_bytes(codec, seg, fmt) / seg
    if decode_gbps is None:
        decode_gbps = measure(fmt)[codec][1] / 1e9
    return ratio, decode_gbps


_PAPER_PARAMS = frozenset({"trace", "more_policies", "policies", "ssd_gbps", "dram_gbps", "paper", "think_s",
                           "think_kind", "capacity_scale", "models", "decode_ms", "loop", "as_json"})
"""The options ``--paper`` takes; it refuses every other one given."""


@click.command("replay")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.argument("more_policies", nargs=-1, metavar="")
@click.option("--policy", "policies", multiple=True,
              help="Policy name(s): --policy lru cost optimal, or repeat --policy, or a,b,c "
                   "[default: lru; with --paper fifo,lru,attentionstore,cost,returns,optimal,unlimited].")
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
@click.option("--dram-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="DRAM -> accelerator read bandwidth, GB/s [default: 20; with --paper 80].")
@click.option("--ssd-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="SSD read bandwidth, GB/s [default: 5; with --paper 20].")
@click.option("--instances", type=click.IntRange(min=1), default=4, show_default=True,
              help="Prefill instances serving the queue.")
@click.option("--ssd-codec", type=click.Choice(["none", "fp8", "int8", "int4"]), default="none",
              show_default=True, help="The SSD tier's codec: it holds more blocks in the same bytes "
                                      "(kvtier's measured ratio for this layout) and decodes on a hit.")
@click.option("--decode-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The codec's decode rate, raw GB/s [default: measured on this machine].")
@click.option("--sweep", is_flag=True,
              help="Sweep DRAM capacity over --fractions of the trace's unique blocks.")
@click.option("--fractions", default="0.01,0.02,0.05,0.1,0.2,0.3,0.5", show_default=True,
              help="DRAM capacities of --sweep, as fractions of the unique blocks.")
@click.option("--paper", type=click.Choice(["attentionstore"]), default=None,
              help="Reproduce a paper's evaluation on TRACE (a sessions trace from kvtier bench "
                   "workload-sharegpt): its four models and capacities, its figures beside kvtier's. "
                   "Of the model, capacity and hardware options above only --ssd-gbps and "
                   "--dram-gbps apply.")
@click.option("--think-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--paper: mean think time between turns, s [default: 60].")
@click.option("--think", "think_kind", type=click.Choice(["exponential", "fixed", "per-session"]), default=None,
              help="--paper: think times exponential (memoryless), fixed at --think-s, or per-session (each "
                   "user a pace around --think-s, gaps gamma around it) [default: per-session].")
@click.option("--capacity-scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--paper: the paper's capacities times this [default: calibrated on the "
                   "13B model's 86% hit rate].")
@click.option("--models", default=None,
              help="--paper: models, a,b,c [default: llama-2-13b,llama-65b,llama-2-70b,falcon-40b].")
@click.option("--decode-ms-per-token", "decode_ms", type=click.FloatRange(min=0), default=None,
              help="--paper: server milliseconds each reply token takes (the server decodes too) "
                   "[default: 0.5, where LRU comes closest to its published 58%].")
@click.option("--loop", type=click.Choice(["closed", "open"]), default=None,
              help="--paper: a session's next turn comes a think time after its reply (closed) or "
                   "after its previous turn's arrival (open) [default: closed].")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per run.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Draw hit ratio against DRAM capacity, one line per policy, to this PNG.")
def replay_cmd(trace: str, more_policies: tuple[str, ...], policies: tuple[str, ...],
               dram_blocks: int | None, ssd_blocks: int | None, dram_bytes: int | None,
               ssd_bytes: int | None, layers: int, kv_heads: int, head_dim: int, dtype: str,
               hidden: int, params: float, tflops: float, dram_gbps: float, ssd_gbps: float,
               instances: int, ssd_codec: str, decode_gbps: float | None, sweep: bool, fractions: str,
               paper: str | None, think_s: float | None, think_kind: str | None, capacity_scale: float | None,
               models: str | None, decode_ms: float | None, loop: str | None, as_json: bool,
               plot_path: str | None) -> None:
    """Replay a Mooncake-format TRACE through placement policies over DRAM (+ SSD)."""
    names = list(dict.fromkeys(n.strip() for p in (*policies, *more_policies) for n in p.split(",") if n.strip()))
    if paper:
        ctx = click.get_current_context()
        given = [param.opts[0] for param in ctx.command.params if param.name not in _PAPER_PARAMS
                 and ctx.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"--paper replays the paper's own models and capacities; drop "
                                   f"{', '.join(given)}")
        from kvtier.cli.paper import paper_cmd

        stated = {"ssd_read_GBps": ssd_gbps, "dram_read_GBps": dram_gbps, "think_mean_s": think_s,
                  "think": think_kind, "closed_loop": None if loop is None else loop == "closed",
                  "decode_s_per_token": None if decode_ms is None else decode_ms / 1e3}
        paper_cmd(trace, tuple(names), {k: v for k, v in stated.items() if v is not None}, capacity_scale,
                  models, as_json)
        return
    for flag, value in (("--think-s", think_s), ("--think", think_kind), ("--capacity-scale", capacity_scale),
                        ("--models", models), ("--decode-ms-per-token", decode_ms), ("--loop", loop)):
        if value is not None:
            raise click.UsageError(f"{flag} applies only with --paper")
    names = names or ["lru"]
    ssd_gbps = 5.0 if ssd_gbps is None else ssd_gbps
    dram_gbps = 20.0 if dram_gbps is None else dram_gbps
    from kvtier.bench.replay import plot as plot_replay
    from kvtier.bench.replay import replay
    from kvtier.bench.replay import sweep as sweep_replay
    from kvtier.bench.replay_config import ReplayConfig
    from kvtier.bench.trace import TraceError, load_trace
    from kvtier.core.cost_model import ComputeModel
    from kvtier.core.layout import KVLayout
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
        ratio, decode = _codec_figures(ssd_codec, layout, decode_gbps)
        configs = [ReplayConfig(policy=n, dram_blocks=dram, ssd_blocks=ssd, layout=layout,
                                dram_read_GBps=dram_gbps, ssd_read_GBps=ssd_gbps,
                                compute=compute, instances=instances, ssd_codec=ssd_codec,
                                ssd_codec_ratio=ratio, ssd_decode_GBps=decode) for n in names]
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
    for col in ("policy", "DRAM blk", "SSD blk" if ssd_codec == "none" else f"SSD blk ({ssd_codec})", "hit blk", "hit tok", "DRAM", "SSD",
                "prefill saved", "TTFT mean s", "p50 s", "p99 s", "SSD wr", "SSD rd", "prefetch acc"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        table.add_row(r.policy, str(r.dram_blocks), str(r.ssd_blocks_held), f"{r.hit_ratio_blocks:.1%}",
                      f"{r.hit_ratio_tokens:.1%}", f"{r.hit_ratio_dram:.1%}", f"{r.hit_ratio_ssd:.1%}",
                      f"{r.prefill_saved:.1%}", f"{r.ttft_mean_s:.3f}", f"{r.ttft_p50_s:.3f}",
                      f"{r.ttft_p99_s:.3f}", f"{r.ssd_bytes_written / 1e9:.0f} GB",
                      f"{r.ssd_bytes_read / 1e9:.0f} GB",
                      "-" if r.prefetch_accuracy is None else f"{r.prefetch_accuracy:.1%}")
    Console().print(table)
    if plot_path:
        Console(stderr=True).print(f"plot written to {plot_path}")
