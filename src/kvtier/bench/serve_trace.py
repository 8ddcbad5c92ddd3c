"""A Mooncake-format request trace (:mod:`kvtier.bench.trace`) served by a real engine: each
row becomes a prompt of token ids whose prefix sharing is the trace's, sent at its arrival time
to an OpenAI-compatible ``/v1/completions`` endpoint, open loop (:func:`run_trace`, from
:mod:`kvtier.bench.serve_trace_client`).

Use: ``work = trace_workload(path, TraceScale(), model_dir)``, then
``records = run_trace(url, model, work.prompts, work.outputs, work.arrivals_s)`` and
``work.turn_records(records)`` for :func:`kvtier.bench.serve_report.build_report`.

A row's ``hash_ids`` name its prompt's 512-token blocks (the last one possibly partial); equal
ids are equal content. Each id becomes one fixed block of ``block_tokens`` token ids, the same
in every process (drawn from numpy's generator seeded with the id and ``seed``, never Python's
``hash()``), so two prompts share exactly the leading blocks their rows share, and the engine's
prefix cache and kvtier see the trace's reuse at a smaller scale.

The defaults of :class:`TraceScale` are sized for a 135M model (SmolLM2-135M) served on two
CPU cores:

- ``block_tokens=16``: a 32x shrink. The example trace's median prompt of 11.6K tokens becomes
  362 tokens and its longest (191K) 5,981: within SmolLM2's 8K context (the engine's
  ``max_model_len`` must cover ``max(final_tokens)``), and a small model's prefill on a CPU
  rather than a large one's on a GPU, while a block is still 16 tokens, half of vLLM's 32-token
  block here, so a shared prefix is a real share of a prompt's compute;
- ``time_scale=1.0``: the trace's own arrival times (the example: 3,993 requests in 1,022 s,
  3.9 a second, 1,870 prompt and 160 reply tokens a second once shrunk and capped). Raise it to
  spread the arrivals out when the engine falls behind (TTFT grows as requests queue in the
  engine; ``lateness_s`` grows when a cap on requests in flight holds them back);
- ``max_output_tokens=None``: every reply is exactly its row's ``output_length`` (the example's
  median 69, its longest 893); a cap (``--trace-max-output``) moves a run's time towards
  prefill, which is what a KV cache speeds up, and the description says how many were capped;
- ``max_input_tokens=None``: no row is skipped unless asked (a model with a short context
  window wants a cap: rows whose prompt is longer once shrunk are skipped and counted).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.bench.chat_client import TurnRecord
from kvtier.bench.serve_trace_client import TraceRecord, lateness_stats, run_trace
from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS, TraceError

__all__ = ["TraceRecord", "TraceRow", "TraceScale", "TraceWorkload", "as_turn_records", "in_family_sample",
           "lateness_stats", "load_trace", "run_trace", "scaled_input_length", "token_pool", "trace_prompts", "trace_workload"]


@dataclass(frozen=True, slots=True)
class TraceRow:
    line: int
    """The row's line in its file (1-based)."""
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _row(obj: object, line: int, where: str, source_block: int) -> TraceRow:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
    stamp = obj["timestamp"]
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not math.isfinite(stamp) or stamp < 0:
        raise TraceError(f"{where}: 'timestamp' must be a finite, non-negative number of ms, got {stamp!r}")
    for name in ("input_length", "output_length"):
        if not _is_int(obj[name]) or obj[name] < 0:
            raise TraceError(f"{where}: {name!r} must be a non-negative integer, got {obj[name]!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers, got {ids!r}"[:300])
    n, length = len(ids), obj["input_length"]
    if length == 0:
        raise TraceError(f"{where}: 'input_length' must be positive (a request needs a prompt)")
    if not (n - 1) * source_block < length <= n * source_block:
        raise TraceError(f"{where}: 'input_length' {length} does not fit {n} hash ids of "
                         f"{source_block}-token blocks (the last one possibly partial)")
    return TraceRow(line, float(stamp), length, obj["output_length"], tuple(ids))


def load_trace(path: str | Path, *, limit: int | None = None, skip: int = 0,
               source_block: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRow]:
    """The rows of the JSONL trace at ``path`` after its first ``skip``, at most ``limit`` of
    them (file order; reading stops there), returned in arrival order (ties in file order).
    Blank lines are skipped. Every row read is validated: a bad one raises
    :class:`~kvtier.bench.trace.TraceError` (a ``ValueError``) naming the file, the line and
    the field; a last line cut short is reported as truncated."""
    if not _is_int(skip) or skip < 0 or (limit is not None and (not _is_int(limit) or limit <= 0)):
        raise ValueError(f"load_trace: skip must be >= 0 and limit positive, got skip={skip!r}, limit={limit!r}")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[TraceRow] = []
    seen = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        seen += 1
        if seen <= skip:
            continue
        where = f"{path}, line {i + 1}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == last and not text.endswith("\n"):
                raise TraceError(f"{where}: truncated (the file's last line is not a whole JSON object)") from None
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:
            raise TraceError(f"{where}: not a valid trace line ({exc})") from None
        rows.append(_row(obj, i + 1, where, source_block))
        if limit is not None and len(rows) == limit:
            break
    if not rows:
        raise TraceError(f"{path}: no requests (after skipping {skip})")
    return sorted(rows, key=lambda r: r.timestamp_ms)


@dataclass(frozen=True)
class TraceScale:
    """How a trace is shrunk to the served model's size (the module docstring: the defaults)."""

    source_block: int = MOONCAKE_BLOCK_TOKENS
    """Tokens per hash id in the trace."""
    block_tokens: int = 16
    """Tokens per hash id as served."""
    time_scale: float = 1.0
    """Arrival times are multiplied by it (2.0: half the rate; 0: all at once)."""
    max_output_tokens: int | None = None
    """A longer reply is capped to it (None: every reply exactly its row's length)."""
    max_input_tokens: int | None = None
    """Rows whose prompt is longer once shrunk are skipped (None: none)."""

    def __post_init__(self) -> None:
        for name in ("source_block", "block_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if name == "max_output_tokens" and value is None:
                continue
            if not _is_int(value) or value <= 0:
                raise ValueError(f"TraceScale.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.time_scale, (int, float)) or isinstance(self.time_scale, bool) \
                or not math.isfinite(self.time_scale) or self.time_scale < 0:
            raise ValueError(f"TraceScale.time_scale must be a finite number >= 0, got {self.time_scale!r}")
        if self.max_input_tokens is not None and (not _is_int(self.max_input_tokens) or self.max_input_tokens <= 0):
            raise ValueError(f"TraceScale.max_input_tokens must be a positive integer or None, "
                             f"got {self.max_input_tokens!r}")


def scaled_input_length(row: TraceRow, scale: TraceScale) -> int:
    """(n-1) * block_tokens + max(1, round(last block's tokens * block_tokens / source_block))."""
    n = len(row.hash_ids)
    tail = row.input_length - (n - 1) * scale.source_block
    if n == 0 or not 0 < tail <= scale.source_block:
        raise ValueError(f"line {row.line}: input_length {row.input_length} does not fit {n} blocks of "
                         f"{scale.source_block} tokens (TraceScale.source_block differs from the trace's?)")
    return (n - 1) * scale.block_tokens + max(1, round(tail * scale.block_tokens / scale.source_block))


def token_pool(vocab_size: int, special_ids: Sequence[int] = ()) -> np.ndarray:
    """The token ids prompts are drawn from: [max(1000, V/100), V - 1000), clear of the low ids
    (bytes, control and special tokens in most vocabularies) and the top ones (reserved and
    added tokens); a vocabulary too small for those margins (less than a quarter of it between
    them) is used whole. ``special_ids`` are left out either way."""
    if not _is_int(vocab_size) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    lo, hi = max(1000, vocab_size // 100), vocab_size - 1000
    if hi - lo < vocab_size // 4:
        lo, hi = 0, vocab_size
    pool = np.setdiff1d(np.arange(lo, hi, dtype=np.int64), np.asarray(list(special_ids), dtype=np.int64))
    if len(pool) < 2:
        raise ValueError(f"a vocabulary of {vocab_size} tokens less its special ids leaves fewer than 2 to draw from")
    return pool


def trace_prompts(rows: Sequence[TraceRow], scale: TraceScale, vocab_size: int, *, seed: int = 0,
                  special_ids: Sequence[int] = ()) -> list[list[int]]:
    """One prompt of token ids per row: each hash id's block of ``scale.block_tokens`` ids (the
    same for the same id, seed and vocabulary, in any process), the last block cut to
    :func:`scaled_input_length`."""
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    pool = token_pool(vocab_size, special_ids)
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        got = blocks.get(hash_id)
        if got is None:  # SeedSequence mixes the integers themselves: stable across processes
            rng = np.random.default_rng([seed, hash_id])
            got = blocks[hash_id] = pool[rng.integers(0, len(pool), size=scale.block_tokens)].tolist()
        return got

    prompts = []
    for row in rows:
        length = scaled_input_length(row, scale)
        prompt = [t for h in row.hash_ids for t in block(h)]
        prompts.append(prompt[:length])
    return prompts


def as_turn_records(rows: Sequence[TraceRow], records: Sequence[TraceRecord]) -> list[TurnRecord]:
    """``records`` as :class:`TurnRecord` for :func:`kvtier.bench.serve_report.build_report`:
    conversation = row index, turn = how many earlier rows share the row's first hash id (0: a
    prefix never seen before, so first-turn and later-turn TTFT split cold from warm prefixes)."""
    turns, seen = [], {}
    for row in rows:
        first = row.hash_ids[0] if row.hash_ids else None
        turns.append(seen.get(first, 0))
        seen[first] = turns[-1] + 1
    out = []
    for r in records:
        if not 0 <= r.index < len(rows):
            raise ValueError(f"record {r.index} has no row (of {len(rows)})")
        out.append(r.as_turn_record(turns[r.index]))
    return sorted(out, key=lambda t: t.conversation)


@dataclass(frozen=True)
class TraceWorkload:
    """What ``kvtier bench serve`` plays from a trace: request ``i`` is ``rows[i]``."""

    rows: list[TraceRow]
    """The rows served, in arrival order (those skipped as too long left out)."""
    prompts: list[list[int]]
    outputs: list[int]
    """Reply lengths, capped at ``max_output_tokens`` (a row's 0 served as 1: a reply has a token)."""
    arrivals_s: list[float]
    """Seconds after the first row served, times ``time_scale``."""
    final_tokens: list[int]
    """Prompt + reply per request: the KV each one comes to."""
    skipped: int
    """Rows over ``max_input_tokens`` once shrunk."""
    capped: int
    """Replies cut to ``max_output_tokens``."""
    description: str
    block_tokens: int = 16
    """Tokens each hash id became."""

    def turn_records(self, records: Sequence[TraceRecord]) -> list[TurnRecord]:
        return as_turn_records(self.rows, records)

    def history_tokens(self) -> dict[int, int]:
        """Request index -> the tokens of its prompt's longest run of leading blocks that an
        earlier request's prompt also began with: what a perfect cache would have for it (its
        history, as a later turn's is the previous prompt and reply)."""
        root: dict[int, dict] = {}  # type: ignore[type-arg]
        out: dict[int, int] = {}
        for i, (row, prompt) in enumerate(zip(self.rows, self.prompts, strict=True)):
            node, shared = root, 0
            for h in row.hash_ids:
                if h not in node:
                    break
                node, shared = node[h], shared + 1
            out[i] = min(shared * self.block_tokens, len(prompt))
            node = root
            for h in row.hash_ids:
                node = node.setdefault(h, {})
        return out


def _vocabulary(tokenizer_dir_or_vocab: str | Path | int) -> tuple[int, list[int]]:
    if _is_int(tokenizer_dir_or_vocab):
        return int(tokenizer_dir_or_vocab), []
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir_or_vocab)
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    return len(tok), sorted(special)


def in_family_sample(row: TraceRow, families: float, seed: int = 0) -> bool:
    """Whether ``row``'s prefix family (the rows whose first hash id is its) is among a
    ``families`` share of all of them: a stable hash of the first id and ``seed`` (the same in
    every process), so a family is kept whole or not at all."""
    digest = hashlib.blake2b(f"{seed}:{row.hash_ids[0]}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < families * (1 << 64)


def trace_workload(path: str | Path, scale: TraceScale, tokenizer_dir_or_vocab: str | Path | int, *,
                   limit: int | None = None, skip: int = 0, seed: int = 0,
                   families: float | None = None) -> TraceWorkload:
    """The trace at ``path`` (rows ``skip`` to ``skip + limit``) shrunk by ``scale`` into
    prompts for a model whose tokenizer is in the given directory (its special ids left out of
    the prompts) or whose vocabulary has the given size. ``families`` keeps that share of the
    trace's prefix families (:func:`in_family_sample`), whole, before ``limit`` keeps the first
    of the rows sampled (in file order; ``skip`` still counts the file's rows): a trace's reuse is mostly across
    minutes (the example's first 48 rows share nothing, its whole 64% of blocks), which a run of
    its first rows never sees and a sample of families over the whole trace keeps, at a rate a
    small machine serves."""
    if families is not None and not (isinstance(families, (int, float)) and 0 < families <= 1):
        raise ValueError(f"trace families must be a share in (0, 1], got {families!r}")
    vocab, special = _vocabulary(tokenizer_dir_or_vocab)
    if families is None:
        loaded = load_trace(path, limit=limit, skip=skip, source_block=scale.source_block)
    else:
        every = load_trace(path, skip=skip, source_block=scale.source_block)
        loaded = [r for r in sorted(every, key=lambda r: r.line) if in_family_sample(r, families, seed)]
        if not loaded:
            raise ValueError(f"{path}: no prefix family falls in a sample of {families:g} of them")
        loaded = sorted(loaded[:limit], key=lambda r: r.timestamp_ms)
    cap = scale.max_input_tokens
    rows = [r for r in loaded if cap is None or scaled_input_length(r, scale) <= cap]
    if not rows:
        raise ValueError(f"{path}: every one of its {len(loaded)} rows is longer than "
                         f"max_input_tokens={cap} once shrunk")
    prompts = trace_prompts(rows, scale, vocab, seed=seed, special_ids=special)
    most = scale.max_output_tokens
    outputs = [max(1, r.output_length if most is None else min(r.output_length, most)) for r in rows]
    capped = 0 if most is None else sum(r.output_length > most for r in rows)
    t0 = rows[0].timestamp_ms
    arrivals = [(r.timestamp_ms - t0) / 1000.0 * scale.time_scale for r in rows]
    finals = [len(p) + o for p, o in zip(prompts, outputs, strict=True)]
    skipped = len(loaded) - len(rows)
    description = (f"{len(rows)} requests of {Path(path).name}"
                   f"{f' (from row {skip})' if skip else ''}"
                   f"{f', prefix families sampled {families:g}' if families is not None else ''}, blocks {scale.source_block}->"
                   f"{scale.block_tokens} tokens, times x{scale.time_scale:g} ({arrivals[-1]:.0f} s)"
                   + (f", replies capped at {most} tokens ({capped} capped)" if most is not None
                      else ", every reply its row's length")
                   + (f", {skipped} skipped over {cap} prompt tokens" if cap is not None else ""))
    return TraceWorkload(rows, prompts, outputs, arrivals, finals, skipped, capped, description, scale.block_tokens)
