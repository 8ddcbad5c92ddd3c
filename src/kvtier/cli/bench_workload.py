"""``kvtier bench workload``: a synthetic ShareGPT-like multi-turn trace in Mooncake format (its
sibling with real ShareGPT sessions: :mod:`kvtier.cli.workload_sharegpt`)."""

from __future__ import annotations

import click


@click.command("workload")
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
