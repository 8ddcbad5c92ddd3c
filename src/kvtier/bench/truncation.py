"""Re-use after truncation: time to first token and agreement, against a recompute.

A chat fills the context window turn by turn; its next question overflows it, so its oldest turns
are dropped (:mod:`kvtier.engines.truncation`). That turn is served two ways in one process:

- ``recompute``: the truncated prompt prefilled whole (what a server does: every position moved,
  every prefix cache misses);
- ``reuse``: the kept turns' KV, saved by the previous turn at its old positions, loaded from
  kvtier's DRAM tier with the keys rotated into place; only the rest is prefilled.

Agreement over the next ``steps`` tokens, both runs teacher-forced on the recompute's greedy
tokens so that the distributions are comparable step by step: ``token_match`` (the re-use's top
token is the recompute's), ``mean_kl`` (KL(recompute || reuse) of the next-token distributions,
nats, averaged over steps) and ``free_match`` (the share of positions where the two free-running
greedy outputs agree; after a first difference the texts drift apart, so this is the strictest).

Each conversation has its own text (``seed + repeat``); the turn before the overflow fits whole,
and its prompt and reply KV is written to a fresh store before each re-use run (a re-use run
saves the truncated sequence under its own keys, which the next run would hit directly). TTFT is
timed ``timings`` times each way, interleaved, per conversation; figures are medians.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoConfig

from kvtier.demo import WORDS, resolve_model
from kvtier.engines.hf import (
    EngineConfig,
    HFEngine,
    Message,
    TurnResult,
    kv_layout_for,
    model_fingerprint,
)
from kvtier.engines.truncation import Render
from kvtier.store import KVStore, StoreConfig
from kvtier.tiers.host_config import HostTierConfig

RATIO_TARGET = 0.15
"""TTFT with re-use over TTFT of the recompute that the capability aims for."""


@dataclass(frozen=True)
class TruncationBenchConfig:
    model: str = "small"
    """A default model size (tiny, small) or a local model directory."""
    context_window: int = 4096
    system_tokens: int = 200
    user_tokens: int | None = None
    """Each earlier question (the default tokenizer is one token a character); default 3/16 of
    the window (768 tokens of 4096), so that the overflow drops about a fifth of the chat."""
    reply_tokens: int = 128
    """Each earlier answer."""
    new_tokens: int = 64
    """The question that overflows the window."""
    steps: int = 64
    """Tokens generated and compared; also the room kept for the reply when truncating."""
    chunk_tokens: int = 256
    repeats: int = 3
    """Conversations."""
    timings: int = 5
    """TTFT measurements per way and conversation (the median is kept)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.user_tokens is None and self.context_window > 0:
            object.__setattr__(self, "user_tokens", self.context_window * 3 // 16)
        for name in ("context_window", "system_tokens", "user_tokens", "reply_tokens",
                     "new_tokens", "steps", "chunk_tokens", "repeats", "timings"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"truncation bench {name} must be positive, got {getattr(self, name)}"
                )
        need = (self.system_tokens + 2 * (self.user_tokens + self.reply_tokens)  # type: ignore[operator]
                + self.new_tokens + self.steps)
        if need > self.context_window:
            raise ValueError(
                f"a context window of {self.context_window} tokens cannot hold the system prompt "
                f"and two turns ({need} tokens): nothing would be left to re-use"
            )


@dataclass(frozen=True, slots=True)
class TruncationRun:
    """One conversation's overflowing turn."""

    untruncated_tokens: int
    prompt_tokens: int
    dropped_turns: int
    dropped_tokens: int
    hit_tokens: int
    """Prompt tokens not prefilled with re-use: the system prompt's and the moved ones."""
    shifted_tokens: int
    ttft_reuse_s: float
    ttft_recompute_s: float
    token_match: float
    free_match: float
    mean_kl: float
    first_kl: float
    """KL of the first generated token's distribution."""


@dataclass(frozen=True)
class TruncationBenchResult:
    config: TruncationBenchConfig
    runs: list[TruncationRun] = field(default_factory=list)

    def _median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.runs)

    @property
    def ttft_reuse_s(self) -> float:
        return self._median("ttft_reuse_s")

    @property
    def ttft_recompute_s(self) -> float:
        return self._median("ttft_recompute_s")

    @property
    def ratio(self) -> float:
        return self.ttft_reuse_s / self.ttft_recompute_s

    @property
    def token_match(self) -> float:
        return self._median("token_match")

    @property
    def free_match(self) -> float:
        return self._median("free_match")

    @property
    def mean_kl(self) -> float:
        return self._median("mean_kl")

    def as_dict(self) -> dict[str, object]:
        summary = {name: getattr(self, name) for name in (
            "ttft_reuse_s", "ttft_recompute_s", "ratio", "token_match", "free_match", "mean_kl")}
        return {"config": asdict(self.config), "runs": [asdict(r) for r in self.runs], **summary}


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def _chat(config: TruncationBenchConfig, seed: int, render: Render, headroom: int) -> list[Message]:
    """System prompt, answered turns, and the first question that overflows the window. The
    turn before it fits whole (its question is cut short if need be), so the overflowing turn
    is the chat's first truncation."""
    rng = random.Random(seed)
    chat: list[Message] = [{"role": "system", "content": _text(rng, config.system_tokens)}]
    new = {"role": "user", "content": _text(rng, config.new_tokens)}
    limit = config.context_window - headroom
    while True:
        room = limit - len(render(chat + [{"role": "user", "content": ""}]))
        question = {"role": "user", "content": _text(rng, min(config.user_tokens or 0, room))}
        turn = [question, {"role": "assistant", "content": _text(rng, config.reply_tokens)}]
        if len(render(chat + turn + [new])) > limit:
            return chat + turn + [new]
        chat += turn


def _kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def run(config: TruncationBenchConfig) -> TruncationBenchResult:
    """Serve each conversation's overflowing turn both ways (see the module docstring)."""
    model_dir = resolve_model(config.model)
    layout = kv_layout_for(AutoConfig.from_pretrained(model_dir), config.chunk_tokens)
    fingerprint = model_fingerprint(model_dir)
    engine_config = EngineConfig(
        max_new_tokens=config.steps, async_save=False, context_window=config.context_window,
        truncation_headroom=config.steps, reuse_after_truncation=True,
    )
    recompute = HFEngine(model_dir, None, engine_config)
    model, tokenizer = recompute.model, recompute.tokenizer
    recompute.generate([{"role": "user", "content": "warm up"}], max_new_tokens=2)

    def reuse(chat: list[Message], saved: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]],
              max_new_tokens: int | None = None, forced: list[int] | None = None) -> TurnResult:
        """The turn served from a fresh store that holds what the previous turn saved."""
        store = KVStore(StoreConfig(model=fingerprint, layout=layout, host=HostTierConfig(
            layout.bytes_for_tokens(3 * config.context_window))))
        store.save(saved, kv)
        engine = HFEngine(model_dir, store, engine_config, model=model, tokenizer=tokenizer)
        try:
            got = engine.generate(chat, max_new_tokens=max_new_tokens, forced_tokens=forced)
        finally:
            engine.close()
        if got.shifted_tokens == 0:
            raise RuntimeError("the overflowing turn re-used no moved KV: nothing was measured")
        return got

    runs: list[TruncationRun] = []
    try:
        for repeat in range(config.repeats):
            chat = _chat(config, config.seed + repeat, recompute.prompt_ids, config.steps)
            # What the previous turn saved: its prompt (it fitted whole) and its reply.
            reply = tokenizer.encode(chat[-2]["content"], add_special_tokens=False)
            saved = recompute.prompt_ids(chat[:-2]) + reply
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([saved]), use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
            kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]

            ttft_reuse, ttft_recompute = [], []
            for _ in range(config.timings):  # interleaved, so that a noisy neighbour hits both
                ttft_recompute.append(recompute.generate(chat, max_new_tokens=1).ttft_s)
                ttft_reuse.append(reuse(chat, saved, kv, max_new_tokens=1).ttft_s)
            free_ref = recompute.generate(chat)
            ref = recompute.generate(chat, forced_tokens=free_ref.token_ids)
            got = reuse(chat, saved, kv, forced=free_ref.token_ids)
            free = reuse(chat, saved, kv)
            assert ref.step_logits is not None and got.step_logits is not None
            kl = _kl(ref.step_logits, got.step_logits)
            top = got.step_logits.argmax(-1) == torch.tensor(ref.token_ids)
            same = sum(a == b for a, b in zip(free.token_ids, free_ref.token_ids, strict=False))
            runs.append(TruncationRun(
                untruncated_tokens=len(recompute.prompt_ids(chat)), prompt_tokens=got.prompt_tokens,
                dropped_turns=got.dropped_turns, dropped_tokens=got.dropped_tokens,
                hit_tokens=got.hit_tokens, shifted_tokens=got.shifted_tokens,
                ttft_reuse_s=statistics.median(ttft_reuse),
                ttft_recompute_s=statistics.median(ttft_recompute),
                token_match=float(top.float().mean()), free_match=same / len(free_ref.token_ids),
                mean_kl=float(kl.mean()), first_kl=float(kl[0]),
            ))
    finally:
        recompute.close()
    return TruncationBenchResult(config, runs)


def format_table(result: TruncationBenchResult) -> str:
    """The runs, one line each, and the medians with the ratio against its target."""
    c = result.config
    head = (f"{'tokens':>7} {'kept':>6} {'dropped':>9} {'reused':>7} {'moved':>6} "
            f"{'TTFT reuse':>11} {'recompute':>10} {'ratio':>6} {'top-1':>6} {'free':>6} {'KL':>7}")
    lines = [(f"model {c.model}, context window {c.context_window}, chunk {c.chunk_tokens}, "
             f"{c.steps} tokens compared"), head]
    for r in result.runs:
        lines.append(
            f"{r.untruncated_tokens:>7} {r.prompt_tokens:>6} {r.dropped_tokens:>5} "
            f"({r.dropped_turns}) {r.hit_tokens:>7} {r.shifted_tokens:>6} "
            f"{r.ttft_reuse_s:>10.3f}s {r.ttft_recompute_s:>9.3f}s "
            f"{r.ttft_reuse_s / r.ttft_recompute_s:>6.3f} {r.token_match:>6.3f} {r.free_match:>6.3f} "
            f"{r.mean_kl:>7.4f}"
        )
    verdict = "meets" if result.ratio <= RATIO_TARGET else "misses"
    lines.append(
        f"median: TTFT {result.ttft_reuse_s:.3f}s with re-use vs {result.ttft_recompute_s:.3f}s "
        f"recompute = {result.ratio:.3f}x ({verdict} the {RATIO_TARGET}x target); top-1 match "
        f"{result.token_match:.3f}, free-running match {result.free_match:.3f}, "
        f"mean KL {result.mean_kl:.4f} nats"
    )
    return "\n".join(lines)
