"""Simulated chat users against an OpenAI-compatible server: streaming turns, timed.

Each user holds one conversation: it sends a turn, reads the streamed reply, keeps the model's
own reply in its history (as a real chat client does), thinks, and sends the next turn. At most
``in_flight`` conversations are open at once; when one ends the next one starts. Given several
servers, a router (a function of conversation and turn) picks the one each turn goes to: the
history travels with the request, so any server can take any turn.

A turn's TTFT is the time from sending the request to the first streamed chunk (vLLM sends
nothing before the first token is sampled); its TPOT is the time from that chunk to the last
one over the reply's remaining tokens. Reply lengths are fixed per turn (``max_tokens`` with
``min_tokens`` and ``ignore_eos``, vLLM's sampling extensions), greedy sampling, and a reply's
text keeps its special tokens, so that it encodes back to the tokens generated.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["PlannedTurn", "Router", "TurnRecord", "run_conversations", "warm_up"]

Router = Callable[[int, int], int]
"""(conversation, turn) -> the index of the server that turn goes to."""


@dataclass(frozen=True, slots=True)
class PlannedTurn:
    user: str
    """The user's message."""
    reply_tokens: int
    """The reply's length in tokens (the real reply's, capped)."""
    system: str | None = None
    """A system message before the user's (a conversation's first turn only)."""
    think_s: float | None = None
    """The pause before this turn (None: the run's ``think_s``; an agent's: the tool's latency)."""
    kv_transfer_params: dict[str, object] | None = None
    """Sent with the request (a session hint: :mod:`kvtier.core.session_hints`)."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    conversation: int
    turn: int
    sent_s: float
    """When it was sent, seconds after the run began."""
    ttft_s: float
    tpot_s: float | None
    """None for a one-token reply."""
    prompt_tokens: int
    cached_tokens: int
    """What vLLM did not compute (its prefix cache and the KV connector together)."""
    completion_tokens: int
    reply: str
    request_id: str = ""
    """The ``X-Request-Id`` it was sent with (vLLM's request id holds it: the daemon's
    per-request log, :mod:`kvtier.server.request_loads`, is joined on it)."""


async def _stream_turn(client, model: str, messages: list[dict[str, str]], reply_tokens: int,  # type: ignore[no-untyped-def]
                       request_id: str = "", kv_transfer_params: dict[str, object] | None = None,
                       ) -> tuple[float, float | None, int, int, int, str]:
    t0 = time.perf_counter()
    # Special tokens are kept in the text (a model with random weights emits them
    # mid-reply): dropped, the history would no longer hold the tokens the model
    # generated, and no cache could serve the reply's KV at the next turn.
    body: dict[str, object] = {"ignore_eos": True, "min_tokens": reply_tokens, "skip_special_tokens": False,
                               "spaces_between_special_tokens": False}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=reply_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=body,
        extra_headers={"X-Request-Id": request_id} if request_id else None,
    )
    first = last = None
    parts: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.choices:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            if chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    if first is None or last is None or usage is None:
        raise RuntimeError("the server's stream ended without a reply or usage")
    details = usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    n = int(usage.completion_tokens)
    tpot = (last - first) / (n - 1) if n > 1 else None
    return first - t0, tpot, int(usage.prompt_tokens), cached, n, "".join(parts)


async def _run(base_urls: Sequence[str], router: Router, model: str, plans: Sequence[Sequence[PlannedTurn]],
               in_flight: int, think_s: float, timeout_s: float, hints: bool) -> list[TurnRecord]:
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=url, api_key="unused", timeout=timeout_s, max_retries=0)
               for url in base_urls]
    gate = asyncio.Semaphore(in_flight)
    records: list[TurnRecord] = []
    start = time.perf_counter()

    async def converse(index: int, plan: Sequence[PlannedTurn]) -> None:
        async with gate:
            messages: list[dict[str, str]] = []
            for turn, planned in enumerate(plan):
                if turn:
                    await asyncio.sleep(think_s if planned.think_s is None else planned.think_s)
                if planned.system is not None and not messages:
                    messages.append({"role": "system", "content": planned.system})
                messages.append({"role": "user", "content": planned.user})
                sent = time.perf_counter() - start
                rid = f"kvtb-{index}-{turn}-{uuid.uuid4().hex[:8]}"
                ttft, tpot, prompt, cached, n, reply = await _stream_turn(
                    clients[router(index, turn)], model, messages, planned.reply_tokens, rid,
                    planned.kv_transfer_params if hints else None)
                records.append(TurnRecord(index, turn, sent, ttft, tpot, prompt, cached, n, reply, rid))
                messages.append({"role": "assistant", "content": reply})

    try:
        await asyncio.gather(*(converse(i, plan) for i, plan in enumerate(plans)))
    finally:
        for client in clients:
            await client.close()
    return sorted(records, key=lambda r: (r.conversation, r.turn))


def run_conversations(base_url: str | Sequence[str], model: str, plans: Sequence[Sequence[PlannedTurn]], *,
                      in_flight: int, think_s: float, timeout_s: float = 600.0,
                      router: Router | None = None, hints: bool = True) -> list[TurnRecord]:
    """Hold every conversation of ``plans`` against the server at ``base_url`` (``.../v1``), or
    against several, each turn sent to ``base_url[router(conversation, turn)]``; the records of
    all turns, by conversation and turn. A failed request raises (a benchmark with a failed turn
    has no meaning). ``hints``: send each turn's ``kv_transfer_params`` (False: none)."""
    if in_flight <= 0 or think_s < 0:
        raise ValueError("in_flight must be positive and think_s not negative")
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if not urls or (router is None and len(urls) > 1):
        raise ValueError("run_conversations needs a server, and a router to spread turns over several")
    return asyncio.run(_run(urls, router or (lambda _c, _t: 0), model, plans, in_flight, think_s, timeout_s,
                            hints))


def warm_up(base_url: str, model: str) -> None:
    """One short request, so that the first measured turn pays no first-request costs."""
    plan = [[PlannedTurn("Warming up: say anything.", 4)]]
    run_conversations(base_url, model, plan, in_flight=1, think_s=0)
