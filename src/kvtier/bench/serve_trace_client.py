"""The client of :mod:`kvtier.bench.serve_trace`: a trace's requests sent to an OpenAI-compatible
``/v1/completions`` endpoint at their arrival times, open loop, each streamed and timed.

Open loop: a request is sent at its arrival time whether or not earlier ones have been answered
(with ``max_in_flight``, once a slot is free: the wait shows as lateness). Its TTFT is the time
from sending to the first streamed chunk, its TPOT the time from that chunk to the last over the
reply's remaining tokens (as :mod:`kvtier.bench.chat_client` measures a turn). Replies are
exactly their planned length: greedy, ``ignore_eos`` and ``min_tokens`` (vLLM's sampling
extensions), special tokens kept in the text.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass

import numpy as np

from kvtier.bench.chat_client import TurnRecord

__all__ = ["TraceRecord", "lateness_stats", "run_trace"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    index: int
    """The row's position in the rows served."""
    sent_s: float
    """When it was sent, seconds after the run began."""
    lateness_s: float
    """Sent minus scheduled (a cap on requests in flight, or a busy client, holds it back)."""
    ttft_s: float
    tpot_s: float | None
    """None for a one-token reply."""
    prompt_tokens: int
    cached_tokens: int
    """What the engine did not compute (its prefix cache and a KV connector together)."""
    completion_tokens: int
    reply: str
    request_id: str = ""
    """The ``X-Request-Id`` it was sent with (the daemon's per-request log is joined on it)."""

    def as_turn_record(self, turn: int) -> TurnRecord:
        """The benchmark's record: conversation = the row's index, turn as given."""
        return TurnRecord(self.index, turn, self.sent_s, self.ttft_s, self.tpot_s, self.prompt_tokens,
                          self.cached_tokens, self.completion_tokens, self.reply, self.request_id)


def lateness_stats(records: Sequence[TraceRecord]) -> dict[str, float | None]:
    """Median, 99th percentile and maximum of the records' lateness, seconds."""
    late = np.asarray([r.lateness_s for r in records], dtype=float)
    if not len(late):
        return {"p50": None, "p99": None, "max": None}
    return {"p50": float(np.percentile(late, 50)), "p99": float(np.percentile(late, 99)), "max": float(late.max())}


async def _stream(client, model: str, prompt: list[int], output: int, request_id: str  # type: ignore[no-untyped-def]
                  ) -> tuple[float, float | None, int, int, int, str]:
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output, temperature=0, stream=True,
        stream_options={"include_usage": True},
        # exactly ``output`` tokens, special ones kept (as chat_client's turns: see there)
        extra_body={"ignore_eos": True, "min_tokens": output, "skip_special_tokens": False,
                    "spaces_between_special_tokens": False},
        extra_headers={"X-Request-Id": request_id},
    )
    first = last = usage = None
    parts: list[str] = []
    async for chunk in stream:
        if chunk.choices:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            parts.append(chunk.choices[0].text or "")
        if chunk.usage is not None:
            usage = chunk.usage
    if first is None or last is None or usage is None:
        raise RuntimeError("the server's stream ended without a reply or usage")
    details = getattr(usage, "prompt_tokens_details", None)
    cached = int(details.cached_tokens or 0) if details is not None else 0
    n = int(usage.completion_tokens)
    tpot = (last - first) / (n - 1) if n > 1 else None
    return first - t0, tpot, int(usage.prompt_tokens), cached, n, "".join(parts)


async def _run(base_url: str, model: str, prompts: Sequence[list[int]], outputs: Sequence[int],
               arrivals_s: Sequence[float], timeout_s: float, max_in_flight: int | None) -> list[TraceRecord]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout_s, max_retries=0)
    gate = asyncio.Semaphore(max_in_flight) if max_in_flight else None
    records: list[TraceRecord] = []
    start = time.perf_counter()

    async def send(i: int) -> None:
        delay = arrivals_s[i] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        slot: AbstractAsyncContextManager[object] = gate if gate is not None else nullcontext()
        async with slot:  # (a semaphore wakes its waiters first come, first served)
            sent = time.perf_counter() - start
            rid = f"kvtb-{i}-0-{uuid.uuid4().hex[:8]}"
            try:
                result = await _stream(client, model, prompts[i], outputs[i], rid)
            except Exception as exc:
                raise RuntimeError(f"trace request {i} (sent at {sent:.2f} s) failed: {exc}") from exc
        records.append(TraceRecord(i, sent, sent - arrivals_s[i], *result, request_id=rid))

    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels the rest
            for i in range(len(prompts)):
                group.create_task(send(i))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    finally:
        await client.close()
    return sorted(records, key=lambda r: r.index)


def run_trace(base_url: str, model: str, prompts: Sequence[list[int]], outputs: Sequence[int],
              arrivals_s: Sequence[float], *, timeout_s: float = 600.0,
              max_in_flight: int | None = None) -> list[TraceRecord]:
    """Send ``prompts[i]`` to ``base_url`` (``.../v1``) ``/completions`` at ``arrivals_s[i]``
    seconds after the start, open loop (no request waits for another's reply; with
    ``max_in_flight``, for a free slot), each reply exactly ``outputs[i]`` tokens (greedy,
    ``ignore_eos`` and ``min_tokens``); the records, by index. A failed request raises, naming
    it, and cancels the others (a benchmark with a failed request has no meaning)."""
    n = len(prompts)
    if len(outputs) != n or len(arrivals_s) != n:
        raise ValueError(f"run_trace needs one output and one arrival per prompt: "
                         f"{n} prompts, {len(outputs)} outputs, {len(arrivals_s)} arrivals")
    if any(not p for p in prompts) or any(not _is_int(o) or o <= 0 for o in outputs):
        raise ValueError("run_trace: every prompt must hold a token and every output be a positive integer")
    if any(not math.isfinite(a) or a < 0 for a in arrivals_s):
        raise ValueError("run_trace: arrivals must be finite and non-negative")
    if max_in_flight is not None and (not _is_int(max_in_flight) or max_in_flight <= 0):
        raise ValueError(f"run_trace: max_in_flight must be a positive integer or None, got {max_in_flight!r}")
    return asyncio.run(_run(base_url, model, prompts, outputs, arrivals_s, timeout_s, max_in_flight))
