"""``kvtier bench serve``'s figures: one run's summary, and the report over every run.

A run's figures are computed over the requests *every* run of every configuration completed
(matched by conversation and turn), so no configuration is judged on turns another one lacks.
Each figure is reported per run and as the median and range over a configuration's runs; ratios
are of medians: every configuration against ``vllm``, and ``kvtier`` against each peer.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from kvtier.bench.chat_client import TurnRecord

__all__ = ["ConfigResult", "Run", "ServeBenchReport", "build_report", "summarize"]

FIGURES = ("ttft_first_mean_s", "ttft_later_mean_s", "ttft_later_p90_s", "tpot_mean_s", "requests_per_s",
           "extra_computed_later_median", "preemptions", "history_from_dram", "history_loaded_from_dram",
           "history_recomputed", "load_wait_mean_s", "daemon_cpu_s_per_request", "engine_over_free_bound")
"""Per run: mean TTFT of first and later turns (and the later turns' p90), mean TPOT,
requests/s, the tokens later turns computed beyond their new ones (median), the requests vLLM
preempted (its pool was full: their KV is freed and computed again, or loaded back by a
connector) -- over the whole run, not only the matched requests; where later turns' history
came from (:func:`history_sources`: shares of DRAM, of DRAM among what kvtier loaded, and
recomputed), the mean wait of a later turn's loads, the kvtier daemon's CPU seconds per request,
and the engine's busy time over what a free, perfect connector would leave
(:func:`free_bound`; with ``--profile``)."""


def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(xs: Sequence[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": statistics.fmean(xs), "p50": _percentile(xs, 0.5), "p90": _percentile(xs, 0.9),
            "p99": _percentile(xs, 0.99)}


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
    """Against the first ``vllm`` run, over the matched requests."""
    turns: list[dict[str, object]] = field(default_factory=list)
    repeat: int = 0
    preemptions: int | None = None
    """vLLM's ``vllm:num_preemptions`` over the run (from its ``/metrics``)."""
    profile: dict[str, object] | None = None
    """The timing proxy's per-step table (:func:`kvtier.bench.peers.profile_report.summarize_profile`)."""
    history: dict[str, object] | None = None
    """Where later turns' history came from (:func:`history_sources`)."""
    cpu_s: dict[str, float | None] | None = None
    """CPU seconds over the run: ``daemon`` (kvtier's) and ``vllm`` (its server and engine)."""
    bound: dict[str, float] | None = None
    """:func:`free_bound` (with a profile)."""


_RID = re.compile(r"kvtb-\d+-\d+-[0-9a-f]{8}")


def _history(records: Sequence[TurnRecord], history_of: Mapping[int, int] | None
             ) -> list[tuple[TurnRecord, int]]:
    """Each request that has a history, and its length in tokens: a later turn's is the previous
    prompt and reply; with ``history_of`` (a trace: conversation -> tokens of its prompt an earlier
    request began with too), that."""
    if history_of is not None:
        return [(r, min(history_of.get(r.conversation, 0), r.prompt_tokens)) for r in records
                if history_of.get(r.conversation, 0) > 0]
    by_turn = {(r.conversation, r.turn): r for r in records}
    out = []
    for r in records:
        prev = by_turn.get((r.conversation, r.turn - 1))
        if prev is not None:
            out.append((r, min(prev.prompt_tokens + prev.completion_tokens, r.prompt_tokens)))
    return out


def history_sources(records: Sequence[TurnRecord], loads: dict[str, dict[str, object]] | None,
                    history_of: Mapping[int, int] | None = None) -> dict[str, object]:
    """Where each later turn's history (the previous prompt and reply) came from, in tokens over
    all later turns: ``engine`` (vLLM's own pool), each kvtier tier it was loaded from at the
    moment it was loaded (``host`` = DRAM, ``disk`` = SSD, a remote tier's name; from the
    daemon's per-request log, :mod:`kvtier.server.request_loads`), ``cached`` (a peer's
    connector or vLLM: not split), and ``recomputed``; the shares of the history; the share of
    DRAM among what kvtier loaded; and the mean and p90 seconds a later turn's steps waited for
    its loads (kvtier only)."""
    by_rid: dict[str, dict[str, object]] = {}
    for name, rec in (loads or {}).items():
        found = _RID.search(name)
        if found:
            by_rid[found.group(0)] = rec
    tokens: dict[str, int] = {}
    waits: list[float] = []
    for r, history in _history(records, history_of):
        cached = min(r.cached_tokens, history)
        rec = by_rid.get(r.request_id) if loads is not None else None
        taken = {str(t): int(n) for t, n in (rec or {}).get("tokens", {}).items()}  # type: ignore[union-attr]
        if loads is not None:
            if rec is not None:
                waits.append(float(rec.get("wait_s", 0.0)))  # type: ignore[arg-type]
            else:
                waits.append(0.0)
            loaded = sum(taken.values())
            from_kvtier = min(loaded, cached)
            for tier, n in taken.items():  # (scaled to what vLLM reports cached: never above it)
                tokens[tier] = tokens.get(tier, 0) + (n * from_kvtier // loaded if loaded else 0)
            tokens["engine"] = tokens.get("engine", 0) + cached - from_kvtier
        else:
            tokens["cached"] = tokens.get("cached", 0) + cached
        tokens["recomputed"] = tokens.get("recomputed", 0) + history - cached
        tokens["history"] = tokens.get("history", 0) + history
    total = tokens.get("history", 0)
    loaded = sum(n for t, n in tokens.items() if t not in ("engine", "cached", "recomputed", "history"))
    return {"tokens": tokens,
            "shares": {t: n / total for t, n in tokens.items() if t != "history"} if total else {},
            "loaded_from_dram": tokens.get("host", 0) / loaded if loaded else None,
            "wait_mean_s": statistics.fmean(waits) if waits else None,
            "wait_p90_s": _percentile(waits, 0.9) if waits else None}


def free_bound(records: Sequence[TurnRecord], engine: dict[str, float] | None, shared_tokens: int = 0,
               history_of: Mapping[int, int] | None = None) -> dict[str, float] | None:
    """The engine's busy time (its run less pauses) and what a free, perfect connector would
    leave of it: no hook cost, and no token computed beyond each request's new ones (a later
    turn's prompt less the previous prompt and reply; a first turn's less the prefix every
    conversation shares) -- the prefill steps' time shrunk by the share of their tokens that
    were beyond; None without a profile's engine figures."""
    if not engine or not engine.get("prefill_tokens"):
        return None
    by_turn = {(r.conversation, r.turn): r for r in records}
    extra = 0
    for r in records:
        prev = by_turn.get((r.conversation, r.turn - 1))
        if history_of is not None:
            new = r.prompt_tokens - history_of.get(r.conversation, 0)
        elif prev is not None:
            new = r.prompt_tokens - prev.prompt_tokens - prev.completion_tokens
        else:
            new = r.prompt_tokens - shared_tokens
        extra += max(0, r.prompt_tokens - r.cached_tokens - max(new, 0))
    busy = float(engine["wall_s"]) - float(engine.get("paused_s", 0.0))
    hooks = float(engine.get("connector_worker_s", 0.0)) + float(engine.get("connector_scheduler_s", 0.0))
    beyond = float(engine["prefill_s"]) * min(1.0, extra / float(engine["prefill_tokens"]))
    free = busy - hooks - beyond
    return {"busy_s": busy, "hooks_s": hooks, "prefill_beyond_new_s": beyond, "tokens_beyond_new": float(extra),
            "free_s": free, "ratio": busy / free if free > 0 else math.inf}


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


@dataclass
class Run:
    """What one run of one configuration gave."""

    name: str
    repeat: int
    records: list[TurnRecord]
    wall_s: float
    pool_tokens: int | None
    kvtier: dict[str, int] | None
    profile: dict[str, object] | None
    preemptions: int | None = None
    loads: dict[str, dict[str, object]] | None = None
    """The daemon's per-request load log (kvtier only)."""
    cpu_s: dict[str, float | None] | None = None


def figures(r: ConfigResult) -> dict[str, float | None]:
    h = r.history or {}
    shares: dict[str, float] = h.get("shares") or {}  # type: ignore[assignment]
    daemon = (r.cpu_s or {}).get("daemon")
    return {"ttft_first_mean_s": r.ttft_first_s["mean"], "ttft_later_mean_s": r.ttft_later_s["mean"],
            "ttft_later_p90_s": r.ttft_later_s.get("p90"),
            "tpot_mean_s": r.tpot_mean_s, "requests_per_s": r.requests_per_s,
            "extra_computed_later_median": r.extra_computed_later["median"],
            "preemptions": r.preemptions,
            "history_from_dram": shares.get("host") if r.kvtier is not None else None,
            "history_loaded_from_dram": h.get("loaded_from_dram"),  # type: ignore[dict-item]
            "history_recomputed": shares.get("recomputed"),
            "load_wait_mean_s": h.get("wait_mean_s"),  # type: ignore[dict-item]
            "daemon_cpu_s_per_request": daemon / r.requests if daemon is not None and r.requests else None,
            "engine_over_free_bound": r.bound["ratio"] if r.bound else None}


def spread(xs: Sequence[float | None]) -> dict[str, object]:
    """Median, min and max of a figure over runs (None where a run lacks it)."""
    got = [x for x in xs if x is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "runs": list(xs)}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "runs": list(xs)}


@dataclass
class ServeBenchReport:
    config: dict[str, object]
    workload: dict[str, object]
    results: list[ConfigResult]
    """One per run, in the order they ran."""
    summary: dict[str, dict[str, dict[str, object]]]
    """Configuration -> figure -> median, min, max and each run's value."""
    ratios: dict[str, dict[str, float | None]]
    """``"a/b"`` -> figure -> median of a / median of b."""
    matched_requests: int
    refused: dict[str, str] = field(default_factory=dict)
    """Configurations that would not start on this platform -> the error they gave."""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"config": self.config, "workload": self.workload,
                "results": [asdict(r) for r in self.results], "summary": self.summary,
                "ratios": self.ratios, "matched_requests": self.matched_requests,
                "refused": self.refused, "notes": self.notes}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_report(config: dict[str, object], workload: dict[str, object], runs: list[Run],
                 refused: dict[str, str], notes: list[str] | None = None, shared_tokens: int = 0,
                 history_of: Mapping[int, int] | None = None) -> ServeBenchReport:
    keys = [{(r.conversation, r.turn) for r in run.records} for run in runs]
    matched = set.intersection(*keys) if keys else set()
    results: list[ConfigResult] = []
    base: dict[tuple[int, int], str] | None = None
    for run in runs:
        records = [r for r in run.records if (r.conversation, r.turn) in matched]
        result = summarize(run.name, records, run.wall_s, run.pool_tokens, run.kvtier)
        result.repeat, result.profile, result.preemptions = run.repeat, run.profile, run.preemptions
        result.history = history_sources(records, run.loads, history_of)
        result.cpu_s = run.cpu_s
        engine = (run.profile or {}).get("engine") if run.profile else None
        result.bound = free_bound(run.records, engine, shared_tokens, history_of)  # type: ignore[arg-type]
        replies = {(r.conversation, r.turn): r.reply for r in records}
        if base is None and run.name == "vllm":
            base = replies
        if base is not None:
            result.differing_replies = sum(replies[k] != base[k] for k in replies)
            result.same_replies_as_vllm = result.differing_replies == 0
        results.append(result)
    names = list(dict.fromkeys(r.name for r in results))
    summary = {name: {f: spread([figures(r)[f] for r in results if r.name == name]) for f in FIGURES}
               for name in names}
    ratios: dict[str, dict[str, float | None]] = {}
    pairs = [(n, "vllm") for n in names if n != "vllm"]
    pairs += [("kvtier", n) for n in names if n not in ("vllm", "kvtier")] if "kvtier" in names else []
    for a, b in pairs:
        if b in summary:
            ratios[f"{a}/{b}"] = {f: _ratio(summary[a][f]["median"], summary[b][f]["median"])  # type: ignore[arg-type]
                                  for f in FIGURES}
    return ServeBenchReport(config, workload, results, summary, ratios, len(matched), refused, notes or [])
