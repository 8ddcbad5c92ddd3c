"""AttentionStore's evaluation (Gao et al., USENIX ATC '24, "Cost-Efficient Large Language Model
Serving for Multi-turn Conversations with CachedAttention"), replayed on real ShareGPT sessions.

The paper's setup: ShareGPT conversations (9K sessions, about 5.75 turns each), new sessions
arriving as a Poisson process at 1 a second, 128 GB of DRAM and 10 TB of SSD per server, four
models whose KV takes 0.78 MB (LLaMA-2-13B), 2.5 MB (LLaMA-65B), 0.31 MB (LLaMA-2-70B) and
0.12 MB (Falcon-40B) a token. Its published hit rates are :data:`PAPER_HIT_RATES` (DRAM and SSD),
:data:`PAPER_DRAM_ONLY` (DRAM only) and :data:`PAPER_POLICIES` (13B, by policy).

What the paper leaves out is the **think time** between a reply and the user's next turn; it
decides how many conversations are alive at once, hence every hit rate. It is calibrated once,
on one published figure (:data:`CALIBRATE_ON`: the 13B model with DRAM only under
AttentionStore's policy, 3.4%), by bisection over an exponential think time's mean; every other
figure is then predicted with that one value.

**Not finished, not yet behind ``kvtier replay --paper``.** On the packaged ShareGPT
conversations neither anchor is reachable by the think time: they are shorter than the paper's
(31% pass 2K tokens against its 84%), so 10 TB holds nearly every live session whatever the think
time (13B, DRAM and SSD: 0.99-1.0 from 140 s to 1e6 s), and DRAM alone stays at 0.14-0.15 (as the
think time grows the trace thins out until the longest sessions, which dominate a block-weighted
hit rate, have DRAM to themselves). A next step must scale the capacities to the dataset's
footprint, weight the hit rate per turn, or calibrate the session length instead. A hit rate here is AttentionStore's: of the KV a
session's earlier turns saved (prompts and replies), the share its next turn finds
(:attr:`kvtier.bench.replay.ReplayResult.hit_rate`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.bench.replay import ReplayConfig, ReplayResult, replay
from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS, Request, Trace
from kvtier.core.cost_model import ComputeModel
from kvtier.core.layout import KVLayout

DRAM_BYTES = 128 << 30
SSD_BYTES = 10 * 10**12
SESSIONS = 9000
SESSION_RATE = 1.0
GPU_FLOPS = 4 * 312e12 * 0.5
"""Four A100s (the paper's server) at half their peak bf16 rate during prefill."""


@dataclass(frozen=True)
class PaperModel:
    name: str
    layout: KVLayout
    compute: ComputeModel

    @property
    def kv_mb_per_token(self) -> float:
        return self.layout.chunk_bytes / self.layout.chunk_tokens / 2**20


def _model(name: str, layers: int, kv_heads: int, head_dim: int, hidden: int, params: float) -> PaperModel:
    layout = KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype="float16",
                      chunk_tokens=MOONCAKE_BLOCK_TOKENS)
    return PaperModel(name, layout, ComputeModel(num_layers=layers, hidden=hidden, params=params,
                                                 flops=GPU_FLOPS))


MODELS = {
    "llama-2-13b": _model("llama-2-13b", 40, 40, 128, 5120, 13e9),  # 0.78 MB a token
    "llama-65b": _model("llama-65b", 80, 64, 128, 8192, 65e9),  # 2.5 MB
    "llama-2-70b": _model("llama-2-70b", 80, 8, 128, 8192, 70e9),  # 0.31 MB (GQA)
    "falcon-40b": _model("falcon-40b", 60, 8, 64, 8192, 40e9),  # 0.12 MB
}
PAPER_HIT_RATES = {"llama-2-13b": 0.86, "llama-65b": 0.71, "llama-2-70b": 0.89, "falcon-40b": 0.90}
"""AttentionStore's hit rates with DRAM and SSD (the paper's Figure 13)."""
PAPER_DRAM_ONLY = {"llama-2-13b": 0.034, "llama-65b": 0.017, "llama-2-70b": 0.077, "falcon-40b": 0.191}
PAPER_POLICIES = {"attentionstore": 0.86, "lru": 0.58, "fifo": 0.48}
"""LLaMA-2-13B, 128 GB DRAM and 10 TB SSD, by policy."""
PAPER_DRAM_SHARE = {"attentionstore": 0.996, "lru": 0.01, "fifo": 0.01}
"""Share of hits served from DRAM: AttentionStore's over 99.6%, LRU's and FIFO's under 1%."""
CALIBRATE_ON = ("llama-2-13b", "attentionstore", True, 0.034)
"""(model, policy, DRAM only, the published hit rate) the think time is fitted to."""
POLICIES = ("fifo", "lru", "attentionstore", "cost")


def retime(trace: Trace, think_mean_s: float, seed: int = 0) -> Trace:
    """``trace`` (a sessions trace: every request names its session) with each session's later
    turns re-timed: the first keeps its arrival, each next one comes an exponential think time
    of mean ``think_mean_s`` after the one before. ValueError on a trace without sessions."""
    if not think_mean_s > 0:
        raise ValueError(f"think time must be positive, got {think_mean_s!r}")
    rng = np.random.default_rng(seed)
    last: dict[object, float] = {}
    timed: list[tuple[float, int, Request]] = []
    for i, req in enumerate(trace.requests):
        if req.session_id is None:
            raise ValueError("the paper's replay needs a trace that names sessions "
                             "(kvtier bench workload-sharegpt writes one)")
        sid = req.session_id
        at = req.arrival_s if sid not in last else last[sid] + float(rng.exponential(think_mean_s))
        last[sid] = at
        timed.append((at, i, dataclasses.replace(req, arrival_s=at)))
    timed.sort(key=lambda t: (t[0], t[1]))
    return Trace([r for _, _, r in timed], trace.unique_blocks, f"{trace.name} think {think_mean_s:.0f}s")


def config_for(model: PaperModel, policy: str, dram_only: bool = False, scale: float = 1.0,
               ssd_read_GBps: float = 5.0) -> ReplayConfig:
    """The paper's server for ``model`` (capacities times ``scale``)."""
    block = model.layout.chunk_bytes
    return ReplayConfig(policy=policy, dram_blocks=max(1, int(DRAM_BYTES * scale // block)),
                        ssd_blocks=0 if dram_only else int(SSD_BYTES * scale // block), layout=model.layout,
                        compute=model.compute, ssd_read_GBps=ssd_read_GBps, dram_read_GBps=20.0)


def calibrate(trace: Trace, lo_s: float = 10.0, hi_s: float = 1e6, rounds: int = 12,
              seed: int = 0, progress: Callable[[float, float], None] | None = None) -> float:
    """The think-time mean at which :data:`CALIBRATE_ON`'s replay hits its published rate
    (bisection on a log scale: a longer think time keeps more sessions alive, so fewer hit)."""
    name, policy, dram_only, target = CALIBRATE_ON
    config = config_for(MODELS[name], policy, dram_only)
    for _ in range(rounds):
        mid = math.sqrt(lo_s * hi_s)
        got = replay(retime(trace, mid, seed), config).hit_rate or 0.0
        if progress is not None:
            progress(mid, got)
        if got > target:
            lo_s = mid
        else:
            hi_s = mid
    return math.sqrt(lo_s * hi_s)


@dataclass(frozen=True)
class PaperRow:
    model: str
    policy: str
    dram_only: bool
    hit_rate: float
    dram_share_of_hits: float
    prefill_saved: float
    paper_hit_rate: float | None
    paper_dram_share: float | None
    capacity_scale: float = 1.0

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _paper_figure(model: str, policy: str, dram_only: bool, scale: float) -> float | None:
    if scale != 1.0:
        return None
    if dram_only:
        return PAPER_DRAM_ONLY[model] if policy == "attentionstore" else None
    if model == "llama-2-13b" and policy in PAPER_POLICIES:
        return PAPER_POLICIES[policy]
    return PAPER_HIT_RATES[model] if policy == "attentionstore" else None


def rows(trace: Trace, think_mean_s: float, *, policies: tuple[str, ...] = POLICIES,
         models: tuple[str, ...] = tuple(MODELS), scales: tuple[float, ...] = (1.0,), seed: int = 0,
         progress: Callable[[PaperRow], None] | None = None) -> list[PaperRow]:
    """Every (model, policy, DRAM only or DRAM + SSD, capacity scale) replayed at one think time."""
    timed = retime(trace, think_mean_s, seed)
    out: list[PaperRow] = []
    for scale in scales:
        for name in models:
            for dram_only in (False, True):
                for policy in policies:
                    result: ReplayResult = replay(timed, config_for(MODELS[name], policy, dram_only, scale))
                    paper_share = PAPER_DRAM_SHARE.get(policy) if (
                        name == "llama-2-13b" and not dram_only and scale == 1.0) else None
                    row = PaperRow(name, policy, dram_only, result.hit_rate or 0.0, result.dram_share_of_hits,
                                   result.prefill_saved, _paper_figure(name, policy, dram_only, scale),
                                   paper_share, scale)
                    out.append(row)
                    if progress is not None:
                        progress(row)
    return out
