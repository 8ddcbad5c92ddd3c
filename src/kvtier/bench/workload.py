"""ShareGPT-like multi-turn sessions, written as a Mooncake-format trace.

Sessions start as a Poisson process. Each opens with one of a few shared system prompts
(popularity Zipf-like), then alternates user turns and replies: a turn's prompt is the whole
history so far plus a new user message, the next turn comes after a think time, and the reply is
appended to the history. Block ids are prefix-chained like Mooncake's: the full blocks of a
system prompt are shared by every session that uses it; a session's later blocks are its own and
keep their ids as its history grows; the last, partial block of a prompt gets a fresh id (its
content changes as the history grows, so it can never be reused).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS, BlockIds, write_request


@dataclass(frozen=True)
class WorkloadConfig:
    requests: int = 10_000
    """Stop after this many requests (turns of all sessions together)."""
    session_rate: float = 1.0
    """New sessions per second (Poisson)."""
    turns_mean: float = 6.0
    """Mean turns per session (geometric, at least 1)."""
    think_mean_s: float = 60.0
    """Mean time between a turn and the next one of the same session (exponential)."""
    system_prompts: int = 8
    system_tokens: int = 2048
    user_tokens_mean: float = 600.0
    output_tokens_mean: float = 300.0
    max_history_tokens: int = 120_000
    """A session ends when its history would pass this (a context window)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "system_prompts", "max_history_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"WorkloadConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.system_tokens, int) or self.system_tokens < 0:
            raise ValueError("WorkloadConfig.system_tokens must be a non-negative int")
        for name in ("session_rate", "think_mean_s", "user_tokens_mean", "output_tokens_mean"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkloadConfig.{name} must be positive, got {getattr(self, name)!r}")
        if not self.turns_mean >= 1:
            raise ValueError(f"WorkloadConfig.turns_mean must be >= 1, got {self.turns_mean!r}")


@dataclass(slots=True)
class _Session:
    system: int
    history: int
    turns_left: int
    blocks: list[int]
    """Ids of the session's full blocks so far."""


def generate(config: WorkloadConfig, out: TextIO) -> int:
    """Write ``config.requests`` requests to ``out``, in timestamp order. Returns the count."""
    rng = np.random.default_rng(config.seed)
    c = MOONCAKE_BLOCK_TOKENS
    blocks = BlockIds()
    system_blocks = [blocks.fresh(config.system_tokens // c) for _ in range(config.system_prompts)]
    popularity = 1.0 / np.arange(1, config.system_prompts + 1)
    popularity /= popularity.sum()

    def lognormal(mean: float) -> int:
        sigma = 0.8
        return max(1, int(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma)))

    events: list[tuple[float, int, int]] = []  # (time s, tie, session), next turns
    sessions: dict[int, _Session] = {}
    next_session_at = 0.0
    tie = written = 0
    while written < config.requests:
        if not events or next_session_at <= events[0][0]:
            system = int(rng.choice(config.system_prompts, p=popularity))
            turns = int(rng.geometric(1.0 / config.turns_mean))
            sessions[tie] = _Session(system, config.system_tokens, turns, list(system_blocks[system]))
            heapq.heappush(events, (next_session_at, tie, tie))
            tie += 1
            next_session_at += float(rng.exponential(1.0 / config.session_rate))
            continue
        now, _, sid = heapq.heappop(events)
        s = sessions[sid]
        prompt = s.history + lognormal(config.user_tokens_mean)
        if prompt > config.max_history_tokens:
            del sessions[sid]
            continue
        ids = blocks.prompt(s.blocks, prompt)
        output = lognormal(config.output_tokens_mean)
        write_request(out, int(now * 1000), prompt, output, ids)
        written += 1
        s.history = prompt + output
        s.turns_left -= 1
        if s.turns_left > 0:
            heapq.heappush(events, (now + float(rng.exponential(config.think_mean_s)), tie, sid))
            tie += 1
        else:
            del sessions[sid]
    return written
