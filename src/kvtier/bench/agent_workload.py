"""``kvtier bench serve --workload agent``: long-memory agent sessions, shaped like a tool loop.

Every session shares one system + tools prompt (``system_tokens``: a system message and the
JSON definitions of a set of tools, as an agent framework sends them), then its own task (a
ShareGPT user message cut to a length drawn from ``task_tokens``), then ``steps`` steps: the
model's short action (``action_tokens``), the tool runs (a pause of ``tool_s``), and its result
comes back as the next user message (a ShareGPT reply cut to ``result_tokens``), so the
history grows by a result and an action at every step. Texts are real (ShareGPT, as chat's);
lengths and latencies are drawn per session and step from a seeded generator, so every
configuration and every repeat plays exactly the same sessions:

- ``task_tokens``, ``result_tokens``, ``action_tokens``: uniform over the (low, high) range;
- ``tool_s``: log-normal with median ``tool_median_s`` and log-deviation ``tool_sigma``, cut
  to ``tool_range_s`` (tools are mostly quick, a few slow: a test run or a web fetch).

Defaults (this machine: a 110M model on 2 cores, where 128 such steps take about five minutes
under vLLM alone): a 1,024-token system + tools prompt, tasks of 128-256 tokens, results of
128-256, actions of 16-32, 8 steps (7 tool results): histories end near 3K tokens; 16
sessions, 8 in flight; tools 2 s median (0.5-8 s). vLLM's pool holds about
``pool_conversations`` of them (2: it holds few of the sessions in flight), kvtier's DRAM
``host_fraction`` of their KV.

With hints on (``--hints on``, kvtier only) each step tells the daemon its session, that it
comes back when the tool returns (``return_s``: the drawn tool latency, which the agent
framework knows -- it just called the tool -- within what this benchmark draws) and to keep it
``retain_s`` (60 s); the last step says ``done``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.bench.chat_client import PlannedTurn
from kvtier.bench.sharegpt import multi_turn

__all__ = ["AgentShape", "agent_plans"]

RETAIN_S = 60.0
"""``retain_s`` of the hints the benchmark sends."""


@dataclass(frozen=True)
class AgentShape:
    sessions: int = 16
    steps: int = 8
    system_tokens: int = 1024
    task_tokens: tuple[int, int] = (128, 256)
    result_tokens: tuple[int, int] = (128, 256)
    action_tokens: tuple[int, int] = (16, 32)
    tool_median_s: float = 2.0
    tool_sigma: float = 0.6
    tool_range_s: tuple[float, float] = (0.5, 8.0)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "steps", "system_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"agent workload {name} must be positive, got {getattr(self, name)}")
        for name in ("task_tokens", "result_tokens", "action_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"agent workload {name} must be a range 0 < low <= high, got {(lo, hi)}")
        lo_s, hi_s = self.tool_range_s
        if not 0 <= lo_s <= self.tool_median_s <= hi_s or self.tool_sigma < 0:
            raise ValueError("agent workload tool_range_s must hold tool_median_s, and tool_sigma be >= 0")


_TOOLS = ("search_code", "read_file", "write_file", "run_tests", "list_directory", "grep",
          "fetch_url", "query_database", "send_message", "create_ticket", "summarize", "diff_files")


def _system_prompt(tok, tokens: int, texts: list[str]) -> str:  # type: ignore[no-untyped-def]
    """A system message and JSON tool definitions (descriptions from real text), cut to ``tokens``."""
    intro = ("You are a software engineering agent. Think step by step, call one tool per step, "
             "and answer with the tool call only. Tools:\n")
    parts = [intro]
    i = 0
    while len(tok.encode("".join(parts), add_special_tokens=False)) < tokens:
        name = _TOOLS[i % len(_TOOLS)] + (f"_{i // len(_TOOLS)}" if i >= len(_TOOLS) else "")
        desc = " ".join(texts[i % len(texts)].split()[:40])
        parts.append(f'{{"name": "{name}", "description": "{desc}", "parameters": {{"type": "object", '
                     f'"properties": {{"query": {{"type": "string"}}, "limit": {{"type": "integer"}}}}}}}}\n')
        i += 1
    return _cut(tok, "".join(parts), tokens)


def _cut(tok, text: str, tokens: int) -> str:  # type: ignore[no-untyped-def]
    """``text`` cut to ``tokens`` tokens (repeated first when shorter)."""
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < tokens and ids:
        ids = ids + ids
    return tok.decode(ids[:tokens])


@dataclass(frozen=True)
class AgentPlans:
    plans: list[list[PlannedTurn]]
    ids: list[str]
    final_tokens: list[int]
    """Each session's history at its end (as planned: actions at their planned length)."""
    system_tokens: int
    """Tokens of the shared prefix as the chat template renders it (system message and all)."""


def agent_plans(shape: AgentShape, model_dir: Path, dataset: str | None = None, *, hints: bool = False
                ) -> AgentPlans:
    """The sessions of ``shape``, as planned turns for :func:`kvtier.bench.chat_client.run_conversations`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(shape.seed)
    # real text: a task per session from a conversation's first human turn, results from replies
    convs = multi_turn(1, shape.sessions + 64, dataset)
    tasks = [c.turns[0][0] for c in convs]
    replies = [gpt for c in convs for _h, gpt in c.turns if len(gpt) > 200]
    system = _system_prompt(tok, shape.system_tokens, replies[-32:])
    plans: list[list[PlannedTurn]] = []
    finals: list[int] = []
    r = 0
    for s in range(shape.sessions):
        plan: list[PlannedTurn] = []
        history = [{"role": "system", "content": system}]
        previous_tool = 0.0
        for step in range(shape.steps):
            if step == 0:
                user = "Task: " + _cut(tok, tasks[s % len(tasks)], int(rng.integers(*shape.task_tokens, endpoint=True)))
            else:
                user = "Tool result:\n" + _cut(tok, replies[r % len(replies)],
                                               int(rng.integers(*shape.result_tokens, endpoint=True)))
                r += 1
            action = int(rng.integers(*shape.action_tokens, endpoint=True))
            tool = float(np.clip(shape.tool_median_s * math.exp(shape.tool_sigma * rng.standard_normal()),
                                 *shape.tool_range_s))
            last = step == shape.steps - 1
            hint = None
            if hints:
                hint = {"session": f"agent-{s}", "done": True} if last else \
                    {"session": f"agent-{s}", "retain_s": RETAIN_S, "return_s": round(tool, 3)}
            # the pause before this step is the tool the previous step called
            plan.append(PlannedTurn(user, action, system=system if step == 0 else None,
                                    think_s=previous_tool, kv_transfer_params={"kvtier": hint} if hint else None))
            previous_tool = tool
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": "x " * action}]
        prompt = tok.apply_chat_template(history[:-1], add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt, list):
            prompt = prompt["input_ids"]
        plans.append(plan)
        finals.append(len(prompt) + plan[-1].reply_tokens)
    head = tok.apply_chat_template(history[:1], tokenize=True)
    head = head if isinstance(head, list) else head["input_ids"]
    return AgentPlans(plans, [f"agent-{s}" for s in range(shape.sessions)], finals, len(head))
