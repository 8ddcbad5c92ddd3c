"""One DRAM budget for three kinds: KV chunks, encoder outputs, vector-index shards.

A mixed workload: the multi-turn sessions of :mod:`kvtier.bench.workload` (KV chunks), images
sent with some turns (encoder outputs; a few images are very popular, most are sent once or
twice), and per-user memory indexes opened by some turns (index shards of several slots each).
Every kind declares what a miss costs: KV chunks their prefill time (the compute model, growing
with position), an image its encoder time, an index its rebuild time. Each request goes through
a :class:`~kvtier.bench.simstore.SimStore` -- the live store's placement and policies, counting
slots -- and a hit saves the recompute time minus the load time.

Compared in one run, at the same DRAM budget (in slots):

- ``cost`` and ``lru`` with one budget shared by all kinds;
- fixed per-kind partitions of the budget (every split on a grid), each partition LRU; the best
  split is the baseline (it is chosen knowing the whole run: a generous baseline);
- the split an operator could set without hindsight: each kind's share of the footprint
  (``footprint_partition``).

Two ceilings show how much room the workload leaves above that baseline, for any policy:

- ``phase_partitions``: the best split chosen again for each phase, in hindsight (what a
  partitioned store re-tuned at every shift of the mix could reach, ignoring the cost of moving);
- ``clairvoyant``: the one budget under :mod:`kvtier.core.policies.clairvoyant`, which knows the
  whole run and evicts the object saving the least per request until its next use (a heuristic
  ceiling, not a proven bound; it saves more than Belady's hit-maximising order here).

With ``phases`` the mix shifts over the run (chat-heavy, then image-heavy, then RAG-heavy
hours), as a day of traffic does; a fixed split cannot follow it, one budget can. A steady mix
(``phases=((1, 1),)``) is reported beside it.
"""

from __future__ import annotations

import io
import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

from kvtier.bench.simstore import SimConfig, SimStore
from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS, parse_trace
from kvtier.bench.workload import WorkloadConfig, generate
from kvtier.core.cost_model import ComputeModel
from kvtier.core.keys import ChunkKey
from kvtier.core.objects import ObjectKind, object_key, part_keys
from kvtier.core.policies.base import TierContext

KINDS = ("kv", "image", "index")


@dataclass(frozen=True)
class ObjectsBenchConfig:
    requests: int = 4000
    """Turns of the session workload (each may also send an image and open an index)."""
    budgets: tuple[float, ...] = (0.05, 0.1, 0.2)
    """DRAM budgets, as fractions of all distinct slots the run touches."""
    image_share: float = 0.3
    """Share of turns that send an image."""
    images: int = 3000
    image_zipf: float = 1.2
    encoder_s: float = 0.15
    """Encoder time per image (declared: a ViT-L/336 on an accelerator, batch of one)."""
    index_share: float = 0.2
    """Share of turns that open their user's memory index."""
    users: int = 400
    index_slots: int = 4
    rebuild_s: float = 2.0
    """Rebuilding one user's index (re-embedding their memories)."""
    slot_bytes: int = 1 << 26
    """One DRAM slot: a 512-token KV chunk of a Llama-3-8B-like model (64 MiB)."""
    dram_GBps: float = 20.0
    phases: tuple[tuple[float, float], ...] = ((0.2, 0.2), (2.0, 0.5), (0.5, 2.5))
    """The run in equal parts, each scaling (image_share, index_share): chat-heavy hours, then
    an image-heavy stretch, then RAG-heavy hours. ``((1, 1),)``: a steady mix."""
    grid: int = 10
    """Fixed partitions: every split of the budget in steps of 1/grid (each kind >= 1 step)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.requests, int) or self.requests <= 0:
            raise ValueError(f"requests must be a positive int, got {self.requests!r}")
        if not self.budgets or any(not 0 < b <= 1 for b in self.budgets):
            raise ValueError(f"budgets must be fractions in (0, 1], got {self.budgets!r}")
        for name in ("image_share", "index_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("encoder_s", "rebuild_s", "dram_GBps", "image_zipf"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("images", "users", "index_slots", "slot_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.phases or any(len(p) != 2 or min(p) < 0 for p in self.phases):
            raise ValueError(f"phases must be (image scale, index scale) pairs >= 0, got {self.phases!r}")
        if not isinstance(self.grid, int) or self.grid < 3:
            raise ValueError(f"grid must be an int >= 3, got {self.grid!r}")


@dataclass(frozen=True, slots=True)
class _Event:
    kind: int
    keys: list[ChunkKey]
    cost_s: float | None
    """Per part, for objects; None for KV (cost from the compute model)."""
    input_length: int = 0
    phase: int = 0


@dataclass
class ObjectsResult:
    budget_slots: int
    unique_slots: int
    possible_s: float
    """Recompute seconds of every request with no cache at all."""
    saved_s: dict[str, float] = field(default_factory=dict)
    """Per policy (``cost``, ``lru``, ``best_partition``, ``footprint_partition``, and the
    ceilings ``phase_partitions`` and ``clairvoyant``): recompute seconds saved."""
    saved_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    best_partition: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The best fixed split (kv, image, index shares of the budget)."""

    @property
    def ratio_vs_partition(self) -> float:
        best = self.saved_s.get("best_partition", 0.0)
        return self.saved_s["cost"] / best if best else float("inf")

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["ratio_vs_partition"] = self.ratio_vs_partition
        return d


def make_events(config: ObjectsBenchConfig) -> list[_Event]:
    """The mixed workload, in arrival order."""
    buf = io.StringIO()
    generate(WorkloadConfig(requests=config.requests, seed=config.seed), buf)
    trace = parse_trace(buf.getvalue().splitlines(), name="sessions")
    rng = np.random.default_rng(config.seed + 1)
    ranks = np.arange(1, config.images + 1, dtype=np.float64) ** -config.image_zipf
    image_p = ranks / ranks.sum()
    user_p = np.arange(1, config.users + 1, dtype=np.float64) ** -0.8
    user_p /= user_p.sum()
    n = len(trace.requests)
    system_blocks = WorkloadConfig().system_tokens // MOONCAKE_BLOCK_TOKENS
    users_of: dict[ChunkKey, int] = {}
    nbytes = config.index_slots * config.slot_bytes - 64  # fills index_slots parts
    events: list[_Event] = []
    for i, req in enumerate(trace.requests):
        phase = len(config.phases) * i // n
        image_scale, index_scale = config.phases[phase]
        image_share = min(1.0, config.image_share * image_scale)
        index_share = min(1.0, config.index_share * index_scale)
        events.append(_Event(0, req.keys, None, req.input_length, phase))
        if rng.random() < image_share:
            image = int(rng.choice(config.images, p=image_p))
            key = object_key(ObjectKind.ENCODER_OUTPUT, f"image-{image}", "vit@1")
            events.append(_Event(1, [key], config.encoder_s, phase=phase))
        if rng.random() < index_share:
            # The session's user: a user's memory is hot while they talk, cold for most of
            # the day. A session is known by its first own block (after the system prompt).
            session = req.keys[min(len(req.keys) - 1, system_blocks)]
            user = users_of.get(session)
            if user is None:
                user = users_of[session] = int(rng.choice(config.users, p=user_p))
            key = object_key(ObjectKind.INDEX_SHARD, f"user-{user}", "v1")
            parts = part_keys(key, nbytes, config.slot_bytes)
            events.append(_Event(2, parts, config.rebuild_s / len(parts), phase=phase))
    return events


def _load_s(config: ObjectsBenchConfig) -> float:
    """Seconds to read one slot from DRAM."""
    return config.slot_bytes / (config.dram_GBps * 1e9)


def _contexts(config: ObjectsBenchConfig, compute: ComputeModel,
              events: list[_Event] | None = None) -> list[TierContext]:
    """With ``events``, the context knows every key's uses (for ``clairvoyant``)."""
    future: dict[ChunkKey, list[int]] | None = None
    if events is not None:
        future = {}
        for seq, ev in enumerate(events):
            for key in ev.keys:
                future.setdefault(key, []).append(seq)
    return [TierContext(level=0, chunk_load_s=_load_s(config), chunk_tokens=MOONCAKE_BLOCK_TOKENS,
                        compute=compute, future=future)]


def _run(events: list[_Event], stores: list[SimStore], route: bool, config: ObjectsBenchConfig,
         compute: ComputeModel) -> np.ndarray:
    """Recompute seconds saved, per phase and kind."""
    load_s = _load_s(config)
    saved = np.zeros((len(config.phases), len(KINDS)))
    c = MOONCAKE_BLOCK_TOKENS
    for seq, ev in enumerate(events):
        sim = stores[ev.kind] if route else stores[0]
        sim.begin(seq, float(seq))
        if ev.cost_s is None:
            hit = sim.lookup(ev.keys)
            got = len(sim.load(hit))
            sim.save(ev.keys)
            tokens = min(got * c, ev.input_length)
            saved[ev.phase, 0] += compute.prefill_s(0, ev.input_length) - compute.prefill_s(
                tokens, ev.input_length) - got * load_s
            continue
        hit = sim.lookup(ev.keys, ev.cost_s)
        if len(hit) == len(ev.keys):
            sim.load(hit, ev.cost_s)
            saved[ev.phase, ev.kind] += len(ev.keys) * (ev.cost_s - load_s)
        else:
            sim.save(ev.keys, ev.cost_s)
    return saved


def _possible(events: list[_Event], compute: ComputeModel) -> float:
    return sum(compute.prefill_s(0, ev.input_length) if ev.cost_s is None
               else ev.cost_s * len(ev.keys) for ev in events)


def run(config: ObjectsBenchConfig) -> list[ObjectsResult]:
    compute = ComputeModel()
    events = make_events(config)
    unique = len({k for ev in events for k in ev.keys})
    footprint = [len({k for ev in events if ev.kind == kind for k in ev.keys}) for kind in range(len(KINDS))]
    possible = _possible(events, compute)
    contexts = _contexts(config, compute)
    oracle = _contexts(config, compute, events)
    results = []
    for fraction in config.budgets:
        budget = max(3, round(fraction * unique))
        res = ObjectsResult(budget_slots=budget, unique_slots=unique, possible_s=possible)
        for policy, ctx in (("cost", contexts), ("lru", contexts), ("clairvoyant", oracle)):
            store = SimStore(SimConfig(policy, budget), ctx)
            by_kind = _run(events, [store], False, config, compute).sum(axis=0)
            res.saved_s[policy] = float(by_kind.sum())
            res.saved_by_kind[policy] = dict(zip(KINDS, by_kind.tolist()))
        g = config.grid
        splits: list[tuple[tuple[float, float, float], np.ndarray]] = []
        for a, b in itertools.product(range(1, g - 1), repeat=2):
            if a + b >= g:
                continue
            shares = (a / g, b / g, (g - a - b) / g)
            caps = [max(1, int(budget * s)) for s in shares]
            stores = [SimStore(SimConfig("lru", cap), contexts) for cap in caps]
            splits.append((shares, _run(events, stores, True, config, compute)))
        shares, best = max(splits, key=lambda split: split[1].sum())
        res.saved_s["best_partition"] = float(best.sum())
        res.best_partition = shares
        res.saved_by_kind["best_partition"] = dict(zip(KINDS, best.sum(axis=0).tolist()))
        per_phase = np.stack([saved.sum(axis=1) for _, saved in splits])  # [split, phase]
        res.saved_s["phase_partitions"] = float(per_phase.max(axis=0).sum())
        stores = [SimStore(SimConfig("lru", max(1, int(budget * n / unique))), contexts) for n in footprint]
        res.saved_s["footprint_partition"] = float(_run(events, stores, True, config, compute).sum())
        results.append(res)
    return results


def format_table(results: list[ObjectsResult]) -> str:
    lines = [("| DRAM budget (slots) | lru | best fixed partition (kv/image/index) | cost | cost / partition "
              "| cost / footprint split | ceilings / partition: per-phase partitions, clairvoyant |"),
             "|---|---|---|---|---|---|---|"]
    for r in results:
        share = "/".join(f"{s:.1f}" for s in r.best_partition)
        best = r.saved_s["best_partition"]
        lines.append(
            f"| {r.budget_slots} of {r.unique_slots} | {r.saved_s['lru']:.1f} s | "
            f"{best:.1f} s ({share}) | {r.saved_s['cost']:.1f} s | **{r.ratio_vs_partition:.2f}x** | "
            f"{r.saved_s['cost'] / r.saved_s['footprint_partition']:.2f}x | "
            f"{r.saved_s['phase_partitions'] / best:.2f}x, {r.saved_s['clairvoyant'] / best:.2f}x |")
    return "\n".join(lines)
