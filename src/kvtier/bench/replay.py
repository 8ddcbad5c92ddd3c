"""Trace replay: how much prefill a placement policy saves, at what DRAM and SSD capacity.

Each request of a :class:`~kvtier.bench.trace.Trace` is served FIFO by the first free of
``instances`` prefill instances. At its start the policies hear ``begin``; the requests that
have arrived by then (up to the policy's ``lookahead``) are announced with ``hint`` and their
chunks prefetched into DRAM while the queue's chunks fit in DRAM (prefetch is assumed to finish
in the background before use). The request then does what an engine does with the store:
``lookup``, ``load``, ``save`` of all its blocks, on a :class:`~kvtier.bench.simstore.SimStore`:
the live store's own :class:`~kvtier.core.placement.Placement` and policy objects, with a mover
that counts chunks instead of copying bytes.

After it, the sequences the DRAM policy stages (``staging``: conversations it predicts are
coming back) are prefetched into DRAM the same way, at the request's start time: in the
background while it is served, so after its own lookup and saves.

Its prefill time is the recompute of the tokens after the loaded prefix (the
:class:`~kvtier.core.cost_model.ComputeModel`, attention growing with position) plus the time to
read each loaded chunk from its tier; TTFT is queueing plus prefill (decoding is not modelled:
prefill instances, as in Mooncake). ``prefill_saved`` is the share of prefill time saved against
no cache; ``compute_saved`` the share of FLOPs.

A codec on the SSD (``ssd_codec``) changes two things: the SSD holds more blocks in the same
bytes (a block is stored at ``ssd_codec_ratio`` of its size), and an SSD hit reads fewer bytes
but then decodes them (``ssd_decode_GBps``). Its quality cost is not modelled here: see
``kvtier bench codecs``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from kvtier.bench.simstore import SimConfig, SimStore
from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS, Trace
from kvtier.core.cost_model import ComputeModel
from kvtier.core.layout import KVLayout
from kvtier.core.policies.base import TierContext
from kvtier.core.policy import LIVE_POLICIES, POLICIES

LLAMA3_8B_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                            chunk_tokens=MOONCAKE_BLOCK_TOKENS)
SWEEP_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


@dataclass(frozen=True)
class ReplayConfig:
    """One replay: a policy, tier capacities in blocks, the hardware and the model."""

    policy: str = "lru"
    dram_blocks: int = 4096
    ssd_blocks: int = 0
    """0: no SSD tier."""
    layout: KVLayout = LLAMA3_8B_LAYOUT
    dram_read_GBps: float = 20.0
    ssd_read_GBps: float = 5.0
    compute: ComputeModel = field(default_factory=ComputeModel)
    instances: int = 4
    ssd_codec: str = "none"
    """The SSD tier's codec (a label: its figures are the two below)."""
    ssd_codec_ratio: float = 1.0
    """Stored bytes over raw bytes of a block with that codec: the SSD holds ``ssd_blocks /
    ratio`` blocks (``ssd_blocks`` counts raw blocks' worth of bytes)."""
    ssd_decode_GBps: float = math.inf
    """Raw GB/s the codec decodes at: an SSD hit reads ``ratio`` of the bytes, then decodes."""
    layerwise: bool = False
    """Layer-wise loading (kvtier's and AttentionStore's): layer ``l+1``'s chunks load while
    layer ``l`` computes, so a request takes ``max(compute, load) + min(compute, load) /
    layers`` instead of their sum."""
    save_replies: bool = True
    """On a trace that names sessions: after a turn, also save the blocks its reply completes
    (named by the session's next prompt), as a store behind an engine that saves generated
    tokens does (kvtier's connector, AttentionStore). Without session ids only prompts are saved."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known policies: {list(POLICIES)}")
        if self.layout.chunk_tokens != MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"layout.chunk_tokens must be {MOONCAKE_BLOCK_TOKENS} (Mooncake blocks)")
        if not isinstance(self.instances, int) or self.instances <= 0:
            raise ValueError(f"instances must be a positive int, got {self.instances!r}")
        for name in ("dram_read_GBps", "ssd_read_GBps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.ssd_codec_ratio <= 1 or (self.ssd_codec == "none") != (self.ssd_codec_ratio == 1):
            raise ValueError(f"ssd_codec_ratio must be in (0, 1], and 1 exactly without a codec; "
                             f"got {self.ssd_codec_ratio!r} for codec {self.ssd_codec!r}")
        if not self.ssd_decode_GBps > 0:
            raise ValueError(f"ssd_decode_GBps must be positive, got {self.ssd_decode_GBps!r}")
        SimConfig(self.policy, self.dram_blocks, self.ssd_blocks)  # validates capacities

    @property
    def ssd_blocks_held(self) -> int:
        """Blocks the SSD holds: its bytes over a block's stored size."""
        return int(self.ssd_blocks / self.ssd_codec_ratio + 1e-9)

    def load_s(self, level: int) -> float:
        if level == 0:
            return self.layout.chunk_bytes / (self.dram_read_GBps * 1e9)
        raw = self.layout.chunk_bytes
        return raw * self.ssd_codec_ratio / (self.ssd_read_GBps * 1e9) + raw / (self.ssd_decode_GBps * 1e9)


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    dram_blocks: int
    ssd_blocks: int
    requests: int
    hit_ratio_blocks: float
    hit_ratio_tokens: float
    hit_ratio_dram: float
    hit_ratio_ssd: float
    prefill_saved: float
    compute_saved: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ssd_bytes_written: int
    ssd_bytes_read: int
    prefetch_accuracy: float | None
    """Share of prefetched chunks a lookup then found in DRAM; None if nothing was prefetched."""
    refused_blocks: int
    ssd_codec: str = "none"
    ssd_blocks_held: int = 0
    """Blocks the SSD held (more than ``ssd_blocks`` with a codec)."""
    hit_rate: float | None = None
    """On a trace that names sessions: of the history blocks saved for a session's earlier
    turns (what a turn could reuse), the share found (AttentionStore's "cache hit rate")."""
    dram_share_of_hits: float = 0.0
    """Of the blocks hit, the share served from DRAM."""
    staged_blocks: int = 0
    """Blocks the policy's staging promoted into DRAM ahead of their requests."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def replay(trace: Trace, config: ReplayConfig) -> ReplayResult:
    """Replay ``trace`` under ``config``. Deterministic."""
    compute, c = config.compute, MOONCAKE_BLOCK_TOKENS
    pcfg = SimConfig(config.policy, config.dram_blocks, config.ssd_blocks_held)
    future = trace.future() if config.policy not in LIVE_POLICIES else None
    contexts = [TierContext(level=lvl, chunk_load_s=config.load_s(lvl), chunk_tokens=c,
                            compute=compute, future=future) for lvl in range(len(pcfg.capacities))]
    place = SimStore(pcfg, contexts)
    load_s = [config.load_s(lvl) for lvl in range(2)]
    lookahead = place.lookahead
    requests = trace.requests
    n = len(requests)
    free = [0.0] * config.instances  # when each instance is next free
    ttft = np.empty(n)
    base_s = cached_s = base_flops = cached_flops = 0.0
    hit_blocks = hit_tokens = total_tokens = 0
    announced = window_blocks = 0
    following = _next_in_session(requests)
    saved_for: dict[int, int] = {}  # request -> its history blocks saved by earlier turns
    reusable = reused = staged = 0
    for seq, req in enumerate(requests):
        start = max(req.arrival_s, free[0])
        place.begin(seq, start)
        if announced <= seq:
            announced = seq
        else:
            window_blocks -= len(req.keys)
        # Announce the queue (this request first): what has arrived by `start`.
        while announced < n and announced < seq + max(lookahead, 1) and (
            announced == seq or requests[announced].arrival_s <= start
        ):
            if lookahead and announced > seq:
                queued = requests[announced].keys
                place.hint(announced, queued)
                window_blocks += len(queued)
                if window_blocks <= config.dram_blocks:
                    place.prefetch(queued)
            announced += 1
        hit = place.lookup(req.keys)
        sources = place.load(hit)
        place.save(req.keys)
        history = saved_for.pop(seq, None)
        if history:
            reusable += history
            reused += min(len(sources), history)
        nxt = following[seq]
        if nxt is not None:
            done = requests[nxt].keys[: (req.input_length + req.output_length) // c] if config.save_replies \
                else req.keys[: req.input_length // c]
            if len(done) > req.input_length // c:
                place.save(done)  # the reply's blocks: the store holds the whole turn now
            saved_for[nxt] = len(done)
        for keys in place.staging(start):
            staged += place.prefetch(keys)
        got = min(len(sources) * c, req.input_length)
        flops = compute.prefill_flops(got, req.input_length)
        full = compute.prefill_flops(0, req.input_length)
        work, load = flops / compute.flops, sum(load_s[lvl] for lvl in sources)
        service = (max(work, load) + min(work, load) / config.layout.num_layers) if config.layerwise \
            else work + load
        heapq.heapreplace(free, start + service)
        ttft[seq] = start + service - req.arrival_s
        hit_blocks += len(sources)
        hit_tokens += got
        total_tokens += req.input_length
        base_s += full / compute.flops
        cached_s += service
        base_flops += full
        cached_flops += flops
    st = place.placement.stats
    ssd_reads = place.mover.reads[1] if len(place.mover.reads) > 1 else 0
    total_blocks = trace.total_blocks
    chunk_bytes = config.layout.chunk_bytes
    stored_bytes = chunk_bytes * config.ssd_codec_ratio
    return ReplayResult(
        policy=config.policy,
        dram_blocks=config.dram_blocks,
        ssd_blocks=config.ssd_blocks,
        requests=n,
        hit_ratio_blocks=hit_blocks / total_blocks if total_blocks else 0.0,
        hit_ratio_tokens=hit_tokens / total_tokens if total_tokens else 0.0,
        hit_ratio_dram=place.hits[0] / total_blocks if total_blocks else 0.0,
        hit_ratio_ssd=sum(place.hits[1:]) / total_blocks if total_blocks else 0.0,
        prefill_saved=1.0 - cached_s / base_s if base_s else 0.0,
        compute_saved=1.0 - cached_flops / base_flops if base_flops else 0.0,
        ttft_mean_s=float(ttft.mean()),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        ssd_bytes_written=int(sum(st.writes_down[1:]) * stored_bytes),
        ssd_bytes_read=int(ssd_reads * stored_bytes),
        prefetch_accuracy=st.prefetch_hits / st.prefetched if st.prefetched else None,
        refused_blocks=st.refused,
        ssd_codec=config.ssd_codec,
        ssd_blocks_held=config.ssd_blocks_held,
        hit_rate=(reused / reusable if reusable else 0.0) if any(r.session_id is not None for r in requests)
        else None,
        dram_share_of_hits=place.hits[0] / sum(place.hits) if sum(place.hits) else 0.0,
        staged_blocks=staged,
    )


def _next_in_session(requests: list) -> list[int | None]:
    """For each request, the number of its session's next request (None: the last, or a trace
    without session ids)."""
    following: list[int | None] = [None] * len(requests)
    last: dict[object, int] = {}
    for seq, req in enumerate(requests):
        sid = req.session_id
        if sid is None:
            continue
        if sid in last:
            following[last[sid]] = seq
        last[sid] = seq
    return following


def sweep(trace: Trace, base: ReplayConfig, policies: list[str],
          fractions: tuple[float, ...] = SWEEP_FRACTIONS) -> list[ReplayResult]:
    """Each policy at DRAM capacities of ``fractions`` of the trace's unique blocks (SSD as in
    ``base``). Results by capacity, then policy."""
    if not fractions or any(not 0 < f for f in fractions):
        raise ValueError(f"fractions must be positive, got {fractions!r}")
    results = []
    for f in fractions:
        dram = max(1, round(f * trace.unique_blocks))
        for policy in policies:
            cfg = dataclasses.replace(base, policy=policy, dram_blocks=dram)
            results.append(replay(trace, cfg))
    return results


def plot(results: list[ReplayResult], unique_blocks: int, path: str) -> None:
    """Hit ratio (blocks) against DRAM capacity, one line per policy, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in results):
        rows = sorted((r for r in results if r.policy == policy), key=lambda r: r.dram_blocks)
        ax.plot([100 * r.dram_blocks / unique_blocks for r in rows],
                [100 * r.hit_ratio_blocks for r in rows], marker="o", label=policy)
    ssd = {r.ssd_blocks for r in results}
    ax.set_xlabel("DRAM capacity, % of the trace's unique blocks")
    ax.set_ylabel("hit ratio, % of blocks")
    ax.set_title(f"hit ratio by DRAM capacity (SSD: {', '.join(str(s) for s in sorted(ssd))} blocks)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
