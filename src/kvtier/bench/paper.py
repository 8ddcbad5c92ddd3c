"""AttentionStore's evaluation (Gao et al., USENIX ATC '24, "Cost-Efficient Large Language Model
Serving for Multi-turn Conversations with CachedAttention"), replayed on real ShareGPT sessions:
``kvtier replay TRACE --paper attentionstore``.

The paper's setup: ShareGPT conversations (9K sessions, about 5.75 turns each), new sessions
arriving as a Poisson process at 1 a second, one server (four A100s) with 128 GB of DRAM and
10 TB of SSD, four models whose KV takes 0.78 MB (LLaMA-2-13B), 2.5 MB (LLaMA-65B), 0.31 MB
(LLaMA-2-70B) and 0.12 MB (Falcon-40B) a token. Its published hit rates are
:data:`PAPER_HIT_RATES` (DRAM and SSD), :data:`PAPER_DRAM_ONLY` (DRAM only) and
:data:`PAPER_POLICIES` (13B, by policy). A hit rate here is the paper's: of the KV a session's
earlier turns saved (prompts and replies), the share its next turn finds
(:attr:`kvtier.bench.replay.ReplayResult.hit_rate`).

What does the replay calibrate? Not the think time: at the paper's own capacities the packaged
ShareGPT sessions' KV fits whatever it is, because they hold far less KV than the paper's (a
mean final context of 2.6K tokens; 31% pass 2K tokens). So the replay fits the **capacity
scale** -- the paper's DRAM and SSD times one factor, the ratio of this dataset's KV footprint
to the paper's -- by bisection on one published figure (:data:`CALIBRATE_ON`: the 13B model with
DRAM and SSD under AttentionStore's policy, 86%), and predicts every other figure with it. The
server also decodes: a reply token costs it :data:`DECODE_S_PER_TOKEN`, fitted by hand once to
a second figure (LRU's 58% on the 13B model). The rest is stated (:class:`Setup`): think times
with a mean of :data:`THINK_S` (it trades off with the scale), by default ``per-session`` (each
user answers at a pace of their own, which varies between users, and their gaps vary around
it: :data:`THINK_KIND`), each counted from the previous turn's reply (a closed loop: a user answers a reply, so behind a queue a
conversation comes back later), the SSD's read bandwidth (:data:`SSD_GBPS`), one server. Loads
overlap compute layer by layer, as in AttentionStore and kvtier. What the replay reproduces and
what it does not, with the reasons, is in the README ("AttentionStore's evaluation on real
ShareGPT sessions").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.bench.replay import ReplayResult, replay, replay_served
from kvtier.bench.replay_config import ReplayConfig
from kvtier.bench.sharegpt_trace import PACE_SHAPE, PACE_SIGMA
from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS, Request, Trace
from kvtier.core.cost_model import ComputeModel
from kvtier.core.layout import KVLayout
from kvtier.core.policy import LIVE_POLICIES

DRAM_BYTES = 128 << 30
SSD_BYTES = 10 * 10**12
GPU_FLOPS = 4 * 312e12 * 0.5
"""Four A100s (the paper's server) at half their peak bf16 rate during prefill."""
THINK_S = 60.0
"""Mean think time between a reply and the session's next turn: not in the paper (see the
module's text)."""
THINK_KIND = "per-session"
"""How think times are drawn by default (:func:`retime`): not in the paper. Each session's own
pace, lognormal around :data:`THINK_S`, and gaps gamma of shape 4 around it: users differ, and
a user's think times vary less than users do. With it, one fitted capacity scale puts the 13B
model's LRU at 57.2% and FIFO at 50.4% beside the paper's 58% and 48% (with memoryless,
``exponential`` think times 60.2% and 54.5%: everything else the same, the scale refitted)."""
DRAM_GBPS = 80.0
"""DRAM -> accelerator bandwidth, GB/s: four A100s, each loading its share over its own PCIe 4.0
x16 link at about 20 GB/s."""
SSD_GBPS = 20.0
"""SSD read bandwidth, GB/s: not in the paper; four NVMe drives of 5 GB/s behind its 10 TB. At
this rate a 13B block (400 MB) loads in about the time its recompute takes (20 vs 21 ms)."""
DECODE_S_PER_TOKEN = 0.5e-3
"""Server seconds a reply token costs: the server decodes as well as prefills, and a decode
step of its batch takes its share. Not in the paper; fitted by hand to LRU's published 58% on
the 13B model (the scale refitted to AttentionStore's 86% at each value), with exponential think
times: LRU's hit rate is 72.7% without decoding, 61.8% at 0.3 ms, 60.3% at 0.5 ms (its lowest),
61.6% at 0.7 ms and 62.1% at 1 ms (with the default per-session ones, 57.2% at 0.5 ms). A
memory-bound decode step of LLaMA-2-13B on four A100s reads the weights once for the batch
and each sequence's KV (about 4.8 GB at these sessions' mean 6.2K-token prompt), which puts the
physical figure near 0.6-1.2 ms at half the HBM bandwidth."""


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
CALIBRATE_ON = ("llama-2-13b", "attentionstore", False, 0.86)
"""(model, policy, DRAM only, the published hit rate) the capacity scale is fitted to."""
POLICIES = ("fifo", "lru", "attentionstore", "cost", "returns")
BOUNDS = ("optimal", "unlimited")
"""References: ``optimal``, Belady's eviction knowing the future at the same capacities (most
block hits; not a bound on prefill saved), and ``unlimited``, every block kept (the bound: no
capacity or policy finds more)."""
CAPACITIES = (1.0, 0.25)
"""The paper's capacities (after calibration) and a quarter of them."""


THINK_KINDS = ("exponential", "fixed", "per-session")
"""As in :data:`kvtier.bench.sharegpt_trace.THINK_TIMES`."""


def _check_think(think_mean_s: float, think: str) -> None:
    if not think_mean_s > 0:
        raise ValueError(f"think time must be positive, got {think_mean_s!r}")
    if think not in THINK_KINDS:
        raise ValueError(f"think must be one of {THINK_KINDS}, got {think!r}")


@dataclass(frozen=True)
class Setup:
    """What the paper does not state, as the replay sets it (see the module's text)."""

    think_mean_s: float = THINK_S
    think: str = THINK_KIND
    seed: int = 0
    """Of the think times drawn."""
    ssd_read_GBps: float = SSD_GBPS
    dram_read_GBps: float = DRAM_GBPS
    decode_s_per_token: float = DECODE_S_PER_TOKEN
    closed_loop: bool = True
    """A session's next turn comes a think time after its reply (closed), or after its previous
    turn's arrival (open: the queue then never delays a conversation's return)."""

    def __post_init__(self) -> None:
        _check_think(self.think_mean_s, self.think)
        for name in ("ssd_read_GBps", "dram_read_GBps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not self.decode_s_per_token >= 0:
            raise ValueError(f"decode_s_per_token must be >= 0, got {self.decode_s_per_token!r}")

    def timed(self, trace: Trace) -> Trace:
        return retime(trace, self.think_mean_s, self.seed, self.think)


def retime(trace: Trace, think_mean_s: float, seed: int = 0, think: str = THINK_KIND) -> Trace:
    """``trace`` (a sessions trace: every request names its session) with each session's later
    turns re-timed: each later turn gets a think time (its ``think_s``), exponential of mean
    ``think_mean_s`` (memoryless: nothing tells when a session comes back), ``fixed`` at it,
    or ``per-session``: each session its own pace (users differ) and gaps that vary around it
    (:attr:`~kvtier.bench.sharegpt_trace.ShareGPTTraceConfig.think`).
    A closed-loop replay counts it from the previous turn's reply; ``arrival_s`` counts it from
    the previous turn's arrival (the open loop), and the first turn keeps its own. ValueError
    on a trace without sessions."""
    _check_think(think_mean_s, think)
    rng = np.random.default_rng(seed)
    last: dict[object, float] = {}
    paces: dict[object, float] = {}

    def think_s(sid: object) -> float:
        if think == "fixed":
            return think_mean_s
        if think == "exponential":
            return float(rng.exponential(think_mean_s))
        if sid not in paces:
            paces[sid] = think_mean_s * float(rng.lognormal(-PACE_SIGMA * PACE_SIGMA / 2, PACE_SIGMA))
        return float(rng.gamma(PACE_SHAPE, paces[sid] / PACE_SHAPE))

    timed: list[tuple[float, int, Request]] = []
    for i, req in enumerate(trace.requests):
        if req.session_id is None:
            raise ValueError("the paper's replay needs a trace that names sessions "
                             "(kvtier bench workload-sharegpt writes one)")
        sid = req.session_id
        gap = None if sid not in last else think_s(sid)
        at = req.arrival_s if gap is None else last[sid] + gap
        last[sid] = at
        timed.append((at, i, dataclasses.replace(req, arrival_s=at, think_s=gap)))
    timed.sort(key=lambda t: (t[0], t[1]))
    return Trace([r for _, _, r in timed], trace.unique_blocks, f"{trace.name} think {think} {think_mean_s:g}s")


def config_for(model: PaperModel, policy: str, dram_only: bool = False, scale: float = 1.0,
               setup: Setup = Setup()) -> ReplayConfig:
    """The paper's server for ``model``, capacities times ``scale``: one instance that prefills
    (layer-wise loading) and decodes, sessions in a closed loop unless ``setup`` says open.
    ``policy`` ``unlimited`` is LRU with room for everything."""
    if not scale > 0:
        raise ValueError(f"capacity scale must be positive, got {scale!r}")
    block = model.layout.chunk_bytes
    dram, ssd = max(1, int(DRAM_BYTES * scale // block)), 0 if dram_only else int(SSD_BYTES * scale // block)
    if policy == "unlimited":
        policy, dram, ssd = "lru", 1 << 40, 0
    return ReplayConfig(policy=policy, dram_blocks=dram, ssd_blocks=ssd, layout=model.layout,
                        compute=model.compute, ssd_read_GBps=setup.ssd_read_GBps,
                        dram_read_GBps=setup.dram_read_GBps, instances=1, layerwise=True,
                        closed_loop=setup.closed_loop, decode_s_per_token=setup.decode_s_per_token)


@dataclass(frozen=True)
class Calibration:
    scale: float
    """The paper's capacities times this."""
    hit_rate: float
    """:data:`CALIBRATE_ON`'s replayed hit rate at ``scale``."""
    reached: bool
    """Whether that is within ``tolerance`` of the published figure (False: the target lies
    outside the searched range, or the hit rate jumps past it)."""


def calibrate(trace: Trace, setup: Setup = Setup(), lo: float = 1e-3, hi: float = 1.0,
              rounds: int = 10, tolerance: float = 0.01,
              progress: Callable[[float, float], None] | None = None) -> Calibration:
    """The capacity scale at which :data:`CALIBRATE_ON`'s replay hits its published rate
    (bisection on a log scale between ``lo`` and ``hi``: more capacity, more hits), with the
    hit rate replayed there and whether it is within ``tolerance`` of the target. The bisection
    assumes the hit rate grows with capacity; on a small trace it may step back (a block more
    can change what the queue does), and then ``reached`` says so."""
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got {lo!r}, {hi!r}")
    name, policy, dram_only, target = CALIBRATE_ON
    timed = setup.timed(trace)

    def hit(scale: float) -> float:
        got = replay(timed, config_for(MODELS[name], policy, dram_only, scale, setup)).hit_rate or 0.0
        if progress is not None:
            progress(scale, got)
        return got

    for _ in range(rounds):
        mid = math.sqrt(lo * hi)
        if hit(mid) < target:
            lo = mid
        else:
            hi = mid
    scale = math.sqrt(lo * hi)
    got = hit(scale)
    return Calibration(scale, got, abs(got - target) <= tolerance)


@dataclass(frozen=True)
class PaperRow:
    model: str
    policy: str
    dram_only: bool
    capacity: float
    """Of the paper's capacities after calibration: 1.0, or 0.25 for a quarter of them."""
    dram_bytes: int | None
    """None for ``unlimited``."""
    ssd_bytes: int | None
    hit_rate: float
    dram_share_of_hits: float
    prefill_saved: float
    ttft_mean_s: float
    paper_hit_rate: float | None
    paper_dram_share: float | None
    prefill_saved_if_staged: float | None = None
    """The replay's :attr:`~kvtier.bench.replay.ReplayResult.prefill_saved_if_staged`: what
    perfect staging could have saved (None for ``unlimited`` and the offline bounds)."""
    prefill_saved_if_in_dram: float | None = None
    """The replay's :attr:`~kvtier.bench.replay.ReplayResult.prefill_saved_if_in_dram`: with
    each request's hits and the replayed schedule kept as they were, each request given as many
    of its hits from DRAM as DRAM holds (queued or not). A bound on placing this replay's hits
    in DRAM, not on another policy, whose hits differ (None as above)."""

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def paper_figures(model: str, policy: str, dram_only: bool) -> tuple[float | None, float | None]:
    """(hit rate, share of hits from DRAM) the paper publishes for this setup at its capacities."""
    if dram_only:
        return (PAPER_DRAM_ONLY[model] if policy == "attentionstore" else None), None
    if model == "llama-2-13b" and policy in PAPER_POLICIES:
        return PAPER_POLICIES[policy], PAPER_DRAM_SHARE[policy]
    return (PAPER_HIT_RATES[model] if policy == "attentionstore" else None), None


def check_models(models: tuple[str, ...]) -> None:
    """ValueError unless ``models`` names at least one of :data:`MODELS`, and only those."""
    if not models:
        raise ValueError(f"name at least one model; the paper's models: {', '.join(MODELS)}")
    for name in models:
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; the paper's models: {', '.join(MODELS)}")


def rows(trace: Trace, scale: float, setup: Setup = Setup(), *,
         policies: tuple[str, ...] = POLICIES + BOUNDS, models: tuple[str, ...] = tuple(MODELS),
         capacities: tuple[float, ...] = CAPACITIES,
         progress: Callable[[PaperRow], None] | None = None) -> list[PaperRow]:
    """Every (capacity, model, DRAM and SSD or DRAM only, policy) replayed at capacity scale
    ``scale`` (the calibrated one) times each of ``capacities``. The paper's figures go beside
    the rows at capacity 1 only. ``unlimited`` is replayed once per model (no capacity
    changes it). In a closed loop ``optimal`` (which must know the order of requests in
    advance) replays the order ``attentionstore`` served at the same capacities, at the times
    they arrived there (an open loop): its hit rate bounds that order's, and its TTFT and
    prefill saved are not those of a closed loop."""
    check_models(models)
    timed = setup.timed(trace)
    offline = setup.closed_loop and any(p not in LIVE_POLICIES for p in policies if p != "unlimited")
    unlimited: dict[str, ReplayResult] = {}
    out: list[PaperRow] = []
    for capacity in capacities:
        for name in models:
            model = MODELS[name]
            block = model.layout.chunk_bytes
            for dram_only in (False, True):
                ahead: tuple[ReplayResult, Trace] | None = None  # attentionstore's, and the order it served

                def attentionstore(config: ReplayConfig) -> tuple[ReplayResult, Trace]:
                    nonlocal ahead
                    if ahead is None:
                        ahead = replay_served(timed, dataclasses.replace(config, policy="attentionstore"))
                    return ahead

                for policy in dict.fromkeys(policies):
                    config = config_for(model, policy, dram_only, scale * capacity, setup)
                    if policy == "unlimited":
                        if name not in unlimited:
                            unlimited[name] = replay(timed, config)
                        result = unlimited[name]
                        dram, ssd = None, None
                    else:
                        if offline and policy not in LIVE_POLICIES:
                            result = replay(attentionstore(config)[1], dataclasses.replace(config, closed_loop=False))
                        elif offline and policy == "attentionstore":
                            result = attentionstore(config)[0]
                        else:
                            result = replay(timed, config)
                        dram, ssd = config.dram_blocks * block, config.ssd_blocks * block
                    hit, share = paper_figures(name, policy, dram_only) if capacity == 1.0 else (None, None)
                    live = policy in LIVE_POLICIES  # the bounds of a live policy's own replay
                    row = PaperRow(name, policy, dram_only, capacity, dram, ssd, result.hit_rate or 0.0,
                                   result.dram_share_of_hits, result.prefill_saved, result.ttft_mean_s, hit, share,
                                   prefill_saved_if_staged=result.prefill_saved_if_staged if live else None,
                                   prefill_saved_if_in_dram=result.prefill_saved_if_in_dram if live else None)
                    out.append(row)
                    if progress is not None:
                        progress(row)
    return out


def gains(table: list[PaperRow], policy: str, over: str = "attentionstore") -> list[tuple[str, bool, float, float | None]]:
    """(model, DRAM only, capacity, ``policy``'s prefill saved over ``over``'s) for every setup
    both ran in; None where ``over`` saved nothing or lost time (no ratio means anything)."""
    by = {(r.model, r.dram_only, r.capacity, r.policy): r for r in table}
    out: list[tuple[str, bool, float, float | None]] = []
    for (model, dram_only, capacity, name), row in by.items():
        base = by.get((model, dram_only, capacity, over))
        if name != policy or base is None:
            continue
        out.append((model, dram_only, capacity,
                    row.prefill_saved / base.prefill_saved if base.prefill_saved > 0 else None))
    return out
