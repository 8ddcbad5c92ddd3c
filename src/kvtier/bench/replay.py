"""Trace replay: how much prefill a placement policy saves, at what DRAM and SSD capacity.

Each request of a :class:`~kvtier.bench.trace.Trace` is served FIFO by the first free of
``instances`` instances. At its start the policies hear ``begin``; the requests that have
arrived by then (up to the policy's ``lookahead``: the whole queue for ``attentionstore`` and
``returns``) are announced with ``hint``; in a closed loop with their arrival times (``arrived``),
a request served as it arrives is announced just before its ``begin``, and each request's end
(its reply done) is told with ``finished``, so a policy can learn think times proper. (In an open
loop a turn's arrival does not follow the reply, and neither is told.) While it computes, the
head of the queue is prefetched into DRAM, as many requests as DRAM holds, and of the first
that does not fit, the prefix that does (prefetch is assumed to finish in the background
before use); a request that waited and that the window did not take whole (it arrived after
the window last moved, or did not fit) is prefetched as far as its wait could read from SSD
(the live store hears of a queued request, and prefetches it, on arrival). Both only for the
policies with a look-ahead: ``lru`` and ``fifo`` are the paper's baselines, which know no
queue. The request then does what an engine does with the store: ``lookup``, ``load``, ``save``
of all its blocks, on a :class:`~kvtier.bench.simstore.SimStore`: the live store's own
:class:`~kvtier.core.placement.Placement` and policy objects, with a mover that counts chunks
instead of copying bytes.

After it, the sequences the DRAM policy stages (``staging``: conversations it predicts are
coming back) are prefetched into DRAM the same way, at the request's start time: in the
background while it is served, so after its own lookup and saves.

Its prefill time is the recompute of the tokens after the loaded prefix (the
:class:`~kvtier.core.cost_model.ComputeModel`, attention growing with position) plus the time to
read each loaded chunk from its tier; TTFT is queueing plus prefill. Decoding is not modelled by
default (prefill instances, as in Mooncake); ``decode_s_per_token`` makes an instance also
decode each reply after its prefill. ``prefill_saved`` is the share of prefill time saved
against no cache; ``compute_saved`` the share of FLOPs.

Arrivals are the trace's (an open loop) unless ``closed_loop``: then a session's next turn
arrives its think time after the previous turn's reply, so a queue delays the conversation's
return as it delays a user waiting for a reply.

A codec on the SSD (``ssd_codec``) changes two things: the SSD holds more blocks in the same
bytes (a block is stored at ``ssd_codec_ratio`` of its size), and an SSD hit reads fewer bytes
but then decodes them (``ssd_decode_GBps``). Its quality cost is not modelled here: see
``kvtier bench codecs``.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import asdict, dataclass

import numpy as np

from kvtier.bench.replay_config import ReplayConfig
from kvtier.bench.replay_queue import _next_in_session, _Queue
from kvtier.bench.simstore import SimConfig, SimStore
from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS, Trace
from kvtier.core.policies.base import TierContext
from kvtier.core.policy import LIVE_POLICIES

SWEEP_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


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
    prefill_saved_if_in_dram: float = 0.0
    """``prefill_saved`` had each request found as many of its hit blocks in DRAM as DRAM
    holds (the same hits, the rest from SSD): what placement in DRAM could still add at this
    capacity, with these hits."""
    prefill_saved_if_staged: float = 0.0
    """The same for the requests served as they arrived only (nothing queued ahead of them,
    so only staging, a prediction of their return, could have put them in DRAM), the others
    as replayed: what perfect staging could add."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def replay(trace: Trace, config: ReplayConfig) -> ReplayResult:
    """Replay ``trace`` under ``config``. Deterministic."""
    return _replay(trace, config)[0]


def replay_served(trace: Trace, config: ReplayConfig) -> tuple[ReplayResult, Trace]:
    """:func:`replay`, and ``trace`` as it served it: in service order, each request at the
    time it arrived (a closed loop decides both as it runs). That is the trace for the offline
    bounds, which must know the order in advance."""
    result, queue = _replay(trace, config)
    order = [dataclasses.replace(trace.requests[i], arrival_s=at, think_s=None) for i, at in queue.served()]
    return result, Trace(order, trace.unique_blocks, f"{trace.name} as {config.policy} served it")


def served_trace(trace: Trace, config: ReplayConfig) -> Trace:
    """``trace`` as ``config``'s replay served it (see :func:`replay_served`)."""
    return replay_served(trace, config)[1]


def _replay(trace: Trace, config: ReplayConfig) -> tuple[ReplayResult, _Queue]:
    compute, c = config.compute, MOONCAKE_BLOCK_TOKENS
    pcfg = SimConfig(config.policy, config.dram_blocks, config.ssd_blocks_held)
    if config.closed_loop and config.policy not in LIVE_POLICIES:
        raise ValueError(f"policy {config.policy!r} needs the trace's future, which a closed loop "
                         "does not know in advance: replay it on served_trace(...) instead")
    future = trace.future() if config.policy not in LIVE_POLICIES else None
    contexts = [TierContext(level=lvl, chunk_load_s=config.load_s(lvl), chunk_tokens=c,
                            compute=compute, future=future) for lvl in range(len(pcfg.capacities))]
    place = SimStore(pcfg, contexts)
    load_s = [config.load_s(lvl) for lvl in range(2)]
    lookahead = place.lookahead
    closed = config.closed_loop  # the policies hear arrivals and replies: a user answers a reply
    requests = trace.requests
    n = len(requests)
    queue = _Queue(requests, config.closed_loop)
    free = [0.0] * config.instances  # when each instance is next free
    ttft = np.empty(n)
    base_s = cached_s = base_flops = cached_flops = in_dram_s = staged_s = 0.0
    hit_blocks = hit_tokens = total_tokens = 0
    announced = fetched = fetch_blocks = part = 0
    following = _next_in_session(requests)
    saved_for: dict[int, int] = {}  # request (its index in the trace) -> its history blocks saved by earlier turns
    reusable = reused = staged = 0
    layers = config.layout.num_layers

    def service_s(work: float, load: float) -> float:
        """A request's prefill: its compute and its loads (overlapped layer by layer)."""
        return max(work, load) + min(work, load) / layers if config.layerwise else work + load

    for seq in range(n):
        index, arrival = queue.serve(seq)
        req = requests[index]
        start = max(arrival, free[0])
        queue.arrive_by(start)
        if fetched <= seq and lookahead and start > arrival and config.ssd_blocks_held:
            # It waited, and the window did not take all of it (it arrived after the window last
            # moved, or did not fit): the live store hears of a request as it arrives and
            # prefetches it in the background, here as far as its wait could read from SSD.
            if announced <= seq:
                place.hint(seq, req.keys, arrival if closed else None)
            late = min(len(req.keys), config.dram_blocks, int((start - arrival) / load_s[1]))
            if late > part:
                place.prefetch(req.keys, limit=late)
        elif closed and lookahead and announced <= seq:  # served as it arrives: it arrived all the same
            place.hint(seq, req.keys, arrival)
        place.begin(seq, start)
        announced = max(seq, announced)
        if fetched <= seq:  # not prefetched, or only its prefix (`part` of its blocks)
            fetched, fetch_blocks, part = seq + 1, fetch_blocks - part, 0
        else:
            fetch_blocks -= len(req.keys)
        # Announce the queue (this request first): what has arrived by `start`.
        while announced < len(queue) and announced < seq + max(lookahead, 1) and (
            announced == seq or queue.arrival(announced) <= start
        ):
            if lookahead and announced > seq:
                place.hint(announced, requests[queue.index(announced)].keys,
                           queue.arrival(announced) if closed else None)
            announced += 1
        hit = place.lookup(req.keys)
        sources = place.load(hit)
        # While it computes, prefetch the head of the queue, as far as DRAM holds it
        # (AttentionStore's prefetching window). The window slides: it counts each queued
        # request's blocks (a shared prefix once per request), and a request prefetched whole
        # is not prefetched again, even if its chunks were evicted before its turn. The first
        # request that does not fit gets the prefix that does (as the live store's prefetch
        # stops where DRAM has no room), from its first block again each time the window slides.
        while fetched < announced:
            keys = requests[queue.index(fetched)].keys
            room = config.dram_blocks - fetch_blocks
            if len(keys) - part > room:
                if room > 0:
                    place.prefetch(keys, limit=part + room)
                    fetch_blocks, part = fetch_blocks + room, part + room
                break
            place.prefetch(keys)
            fetch_blocks += len(keys) - part
            fetched, part = fetched + 1, 0
        place.save(req.keys)
        history = saved_for.pop(index, None)
        if history:
            reusable += history
            reused += min(len(sources), history)
        nxt = following[index]
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
        service = service_s(work, load)
        end = start + service + req.output_length * config.decode_s_per_token  # its reply done
        below = sum(1 for lvl in sources if lvl > 0)  # of its hits, as many from DRAM as it holds
        moved = min(below, max(0, config.dram_blocks - (len(sources) - below)))
        best_s = service
        if moved:
            best_load = load - moved * (load_s[1] - load_s[0])
            best_s = min(service, service_s(work, best_load))
        in_dram_s += best_s
        staged_s += best_s if start <= arrival else service
        heapq.heapreplace(free, end)
        if closed:
            place.finished(seq, end)
        ttft[seq] = start + service - arrival
        if nxt is not None:
            queue.reply_done(nxt, end)
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
        prefill_saved_if_in_dram=1.0 - in_dram_s / base_s if base_s else 0.0,
        prefill_saved_if_staged=1.0 - staged_s / base_s if base_s else 0.0,
    ), queue


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
