"""The conversations ``kvtier bench serve`` plays (:mod:`kvtier.bench.serve`): ShareGPT turns cut
to the served model's tokens, and the KV they come to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.bench.chat_client import PlannedTurn
from kvtier.bench.serve_config import ServeBenchConfig
from kvtier.bench.sharegpt import multi_turn

if TYPE_CHECKING:
    from kvtier.bench.serve_trace import TraceWorkload

__all__ = ["Workload", "build_workload", "kv_bytes_per_token"]


@dataclass(frozen=True)
class Workload:
    plans: list[list[PlannedTurn]]
    ids: list[str]
    final_tokens: list[int]
    """Each conversation's history at its end (last prompt + last reply), as planned."""
    kv_bytes_per_token: int
    shared_tokens: int = 0
    """Tokens every conversation starts with (agent: the system + tools prompt): what a
    perfect cache computes once, for the free-connector bound."""
    trace: TraceWorkload | None = None
    """A trace to replay instead of ``plans`` (``--trace``)."""

    @property
    def kv_bytes(self) -> int:
        return sum(self.final_tokens) * self.kv_bytes_per_token


def kv_bytes_per_token(model_dir: Path) -> int:
    """float32 K and V of every layer (vLLM runs with ``--dtype float32`` here)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * 4


def build_workload(config: ServeBenchConfig, model_dir: Path) -> Workload:
    if config.trace is not None:
        from kvtier.bench.serve_trace import TraceScale, trace_workload

        scale = TraceScale(block_tokens=config.trace_block_tokens, time_scale=config.trace_time_scale,
                           max_output_tokens=config.trace_max_output)
        tw = trace_workload(config.trace, scale, model_dir, limit=config.trace_limit,
                            families=config.trace_families)
        return Workload([], [str(r.line) for r in tw.rows], list(tw.final_tokens), kv_bytes_per_token(model_dir),
                        trace=tw)
    if config.workload == "agent":
        from kvtier.bench.agent_workload import AgentShape, agent_plans

        shape = AgentShape(sessions=config.conversations, steps=config.turns)
        got = agent_plans(shape, model_dir, config.dataset, hints=True)
        return Workload(got.plans, got.ids, got.final_tokens, kv_bytes_per_token(model_dir), got.system_tokens)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    convs = multi_turn(config.turns, config.conversations, config.dataset, config.skip)
    plans, finals = [], []
    for conv in convs:
        plan, history = [], []
        for human, gpt in conv.turns[: config.turns]:
            ids = tok.encode(human, add_special_tokens=False)[: config.max_user_tokens]
            user = tok.decode(ids)
            reply_ids = tok.encode(gpt, add_special_tokens=False)[: config.max_reply_tokens]
            plan.append(PlannedTurn(user, max(1, len(reply_ids))))
            # the planned history stands the real reply, cut to length, in for the model's own
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": tok.decode(reply_ids)}]
        prompt = tok.apply_chat_template(history[:-1], add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt, list):
            prompt = prompt["input_ids"]
        plans.append(plan)
        finals.append(len(prompt) + plan[-1].reply_tokens)
    return Workload(plans, [c.id for c in convs], finals, kv_bytes_per_token(model_dir))
