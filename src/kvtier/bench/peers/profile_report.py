"""The per-step table of a profiled run: the timing proxy's lines
(:mod:`kvtier.bench.peers.connector_profile`) joined by step and summed up per kind of step.

For each kind (``decode``: every scheduled request computes one token; ``prefill``: some
request computes more), per step on average: the time in each scheduler-side and worker-side
hook, the worker's span (``bind_connector_metadata`` to ``clear_connector_metadata``: the
forward pass with the hooks in it), daemon round trips (on the step's connection and in the
background) and their latency, the times the engine loop blocked on a daemon call
(``loop_waits``: a connector's calls may run on threads of their own) and the milliseconds it
blocked per step, bytes copied; and the share of the step's time (span plus the
scheduler hooks) that all hooks together take, as a ratio of sums over the steps. The same
two figures net of the proxy's own cost (its ``probe_s`` per hook call, taken out of each
hook's time) say what the connector itself costs. ``decode, nothing moved`` is the decode
steps that copied no byte (nothing loaded or saved in them): the steps a connector should
not be seen in.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["summarize_profile"]

KINDS = ("decode", "decode, nothing moved", "prefill")


def _lines(directory: Path, side: str) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for path in sorted(directory.glob(f"{side}-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a server that was killed mid-write
                continue
    return out


def _hook_s(line: dict[str, object] | None) -> dict[str, float]:
    hooks = (line or {}).get("hooks") or {}
    return {name: float(v[0]) for name, v in hooks.items()}  # type: ignore[union-attr]


def _net_s(line: dict[str, object] | None) -> float:
    """The line's hook seconds net of the proxy's cost (never below nothing per hook)."""
    hooks = (line or {}).get("hooks") or {}
    probe = float((line or {}).get("probe_s") or 0.0)  # type: ignore[arg-type]
    return sum(max(0.0, float(v[0]) - probe * int(v[1])) for v in hooks.values())  # type: ignore[union-attr]


def _moved(w: dict[str, object]) -> float:
    return _counter(w, "loaded_bytes") + _counter(w, "saved_bytes")


def _counter(line: dict[str, object] | None, name: str) -> float:
    return float(((line or {}).get("counters") or {}).get(name, 0))  # type: ignore[union-attr]


def summarize_profile(directory: Path) -> dict[str, object]:
    """``{kind: {...figures...}}`` for the steps the lines in ``directory`` record (see the
    module docstring); ``{}`` when there are none."""
    scheduler = {int(x["step"]): x for x in _lines(directory, "scheduler")}  # type: ignore[arg-type]
    workers = [x for x in _lines(directory, "worker") if int(x.get("step", 0)) > 0]  # type: ignore[arg-type]
    out: dict[str, object] = {}
    for kind in KINDS:
        if kind == "decode, nothing moved":
            steps = [(w, scheduler.get(int(w["step"]))) for w in workers  # type: ignore[arg-type]
                     if w.get("kind") == "decode" and not _moved(w)]
        else:
            steps = [(w, scheduler.get(int(w["step"]))) for w in workers if w.get("kind") == kind]  # type: ignore[arg-type]
        if not steps:
            continue
        n = len(steps)
        sched_hooks: dict[str, float] = {}
        work_hooks: dict[str, float] = {}
        span = hooks_total = net_total = 0.0
        trips = trips_s = bg_trips = bg_s = moved = waits = wait_s = 0.0
        with_trips = with_waits = 0
        for w, s in steps:
            step_sched, step_work = _hook_s(s), _hook_s(w)
            for name, sec in step_sched.items():
                sched_hooks[name] = sched_hooks.get(name, 0.0) + sec
            for name, sec in step_work.items():
                work_hooks[name] = work_hooks.get(name, 0.0) + sec
            span += float(w["span_s"])  # type: ignore[arg-type]
            hooks_total += sum(step_sched.values()) + sum(step_work.values())
            net_total += _net_s(s) + _net_s(w)
            step_trips = _counter(s, "round_trips") + _counter(w, "round_trips")
            trips += step_trips
            with_trips += step_trips > 0
            trips_s += _counter(s, "round_trip_s") + _counter(w, "round_trip_s")
            step_waits = _counter(s, "loop_waits") + _counter(w, "loop_waits")
            waits += step_waits
            with_waits += step_waits > 0
            wait_s += _counter(s, "loop_wait_s") + _counter(w, "loop_wait_s")
            bg_trips += _counter(s, "background_round_trips") + _counter(w, "background_round_trips")
            bg_s += _counter(s, "background_round_trip_s") + _counter(w, "background_round_trip_s")
            moved += _moved(w)
        sched_total = sum(sched_hooks.values())
        out[kind] = {
            "steps": n,
            "span_ms": 1000 * span / n,
            "scheduler_hooks_ms": {k: 1000 * v / n for k, v in sorted(sched_hooks.items())},
            "worker_hooks_ms": {k: 1000 * v / n for k, v in sorted(work_hooks.items())},
            "hooks_ms": 1000 * hooks_total / n,
            "hooks_share": hooks_total / (span + sched_total) if span + sched_total else None,
            "hooks_net_ms": 1000 * net_total / n,
            "hooks_net_share": net_total / (span + sched_total) if span + sched_total else None,
            "round_trips": trips / n,
            "steps_with_round_trips": with_trips,
            "round_trip_ms": 1000 * trips_s / trips if trips else None,
            "loop_waits": waits / n,
            "steps_with_loop_waits": with_waits,
            "loop_wait_ms": 1000 * wait_s / n,
            "background_round_trips": bg_trips / n,
            "background_round_trip_ms": 1000 * bg_s / bg_trips if bg_trips else None,
            "bytes_copied": moved / n,
        }
    return out
