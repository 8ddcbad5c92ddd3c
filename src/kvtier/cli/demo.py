"""``kvtier demo``: multi-turn chats on the embedded model, with and without the store."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table


@click.command()
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
