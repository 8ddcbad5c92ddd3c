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

``engine`` (:func:`engine_time`) is where the engine's time went over the run's requests: the
forward spans of prefill and of decode steps, the connector's hooks (in the spans and between
them), vLLM's own work between steps, pauses; with the tokens computed in each kind of step and
the requests per decode step. It says what a connector can still win: its hits shorten prefill
spans (fewer tokens computed) and its hooks are its own cost; the rest is vLLM's work on the
tokens and batches the run gave it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["engine_time", "summarize_profile"]

KINDS = ("decode", "decode, nothing moved", "prefill")
IDLE_GAP_S = 0.2
"""A pause between two steps (less the connector's scheduler hooks) this long or longer is the
engine paused (no request to run, or a stall), not vLLM's work between steps (milliseconds)."""


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


def _jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    """The lines of one of the proxy's files, less a line cut by a server killed mid-write."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _worker_lines(directory: Path, since: float | None = None, until: float | None = None
                  ) -> tuple[list[dict], int]:  # type: ignore[type-arg]
    """The lines of the worker file with the most steps between ``since`` and ``until`` (steps
    wholly inside; a window needs lines that carry their time, ``t``), in the order written: one
    rank's (tensor-parallel ranks run the same steps; a restarted worker writes a file of its
    own, and only the longer life is read). Also how many worker files have steps there."""
    best: list[dict] = []  # type: ignore[type-arg]
    files = 0
    for path in sorted(directory.glob("worker-*.jsonl")):
        lines = []
        for x in _jsonl(path):
            if "span_s" not in x:
                continue
            if since is not None or until is not None:
                if "t" not in x:
                    continue
                began, ended = float(x["t"]) - float(x["span_s"]), float(x["t"])
                if (since is not None and began < since) or (until is not None and ended > until):
                    continue
            lines.append(x)
        files += bool(lines)
        if len(lines) > len(best):
            best = lines
    return best, files


def _scheduler_lines(directory: Path) -> dict[tuple[int, int], dict]:  # type: ignore[type-arg]
    """The scheduler's lines by (its pid, step): each engine-core process numbers its steps."""
    out: dict[tuple[int, int], dict] = {}  # type: ignore[type-arg]
    for path in sorted(directory.glob("scheduler-*.jsonl")):
        for x in _jsonl(path):
            out[(int(x.get("pid", 0)), int(x.get("step", 0)))] = x
    return out


def _scheduler_of(worker: dict, scheduler: dict[tuple[int, int], dict]) -> dict | None:  # type: ignore[type-arg]
    """The scheduler's line of the step a worker line records (None: a step the scheduler did
    not number -- it computed nothing -- or a lost line)."""
    step = int(worker.get("step", 0))
    return scheduler.get((int(worker.get("scheduler", 0)), step)) if step > 0 else None


def engine_time(directory: Path, since: float | None = None, until: float | None = None
                ) -> dict[str, float | int] | None:
    """Where the engine's time went between ``since`` and ``until`` (``time.monotonic()``; the
    steps wholly inside; None: from the first step, to the last), from one worker's lines (see
    :func:`_worker_lines`); None without lines that carry their time (``t``).

    Seconds: ``prefill_s``, ``decode_s``, ``other_s`` (steps that computed nothing -- a request
    loading between steps -- and every step of a connector whose metadata takes no attribute)
    are the worker's spans less the connector's worker hooks in them (``connector_worker_s``);
    between two spans, the next step's scheduler hooks (``connector_scheduler_s``; a step that
    computed nothing has no scheduler line, and its hooks go with the next one's), then
    ``between_steps_s`` (vLLM's scheduling, input preparation, sampling and output handling, the
    proxy writing its lines, and short pauses) or, for the rest of a pause of
    :data:`IDLE_GAP_S` or more, ``paused_s`` (no request to run, or a stall). They sum to
    ``wall_s``. Hook times include the proxy's own cost (its ``probe_s`` a call). Scheduler
    hooks are taken out of the gaps, where they run when the scheduler and the worker take
    turns (one process, vLLM's default on one device); with tensor parallelism they overlap the
    spans instead. On an accelerator a span is the host's time to launch the step's work and the
    device's compute may land between steps; on vLLM's CPU backend the span is the forward pass.
    Counts: steps of each kind, tokens computed in them and requests per decode step (over the
    ``matched_steps`` whose scheduler line was found), worker files in the window."""
    lines, files = _worker_lines(directory, since, until)
    return _engine(lines, files, _scheduler_lines(directory))


def _engine(lines: list[dict], files: int, scheduler: dict[tuple[int, int], dict]  # type: ignore[type-arg]
            ) -> dict[str, float | int] | None:
    """:func:`engine_time` of one worker's lines read already (``files``: worker files read)."""
    if not lines or any("t" not in x for x in lines):
        return None
    out: dict[str, float | int] = dict.fromkeys(
        ("prefill_s", "decode_s", "other_s", "connector_worker_s", "connector_scheduler_s",
         "between_steps_s", "paused_s"), 0.0)
    out.update(dict.fromkeys(("prefill_steps", "decode_steps", "other_steps", "prefill_tokens",
                              "decode_tokens", "matched_steps"), 0))
    decode_requests = decode_matched = 0
    out["wall_s"] = float(lines[-1]["t"]) - (float(lines[0]["t"]) - float(lines[0]["span_s"]))
    before: dict | None = None  # type: ignore[type-arg]
    for x in lines:
        kind = x.get("kind") if x.get("kind") in ("prefill", "decode") else "other"
        hooks = min(float(x["span_s"]), sum(_hook_s(x).values()))
        out[f"{kind}_s"] += float(x["span_s"]) - hooks
        out["connector_worker_s"] += hooks
        out[f"{kind}_steps"] += 1
        s = _scheduler_of(x, scheduler)
        if s is not None and kind != "other":
            out["matched_steps"] += 1
            out[f"{kind}_tokens"] += int(s.get("tokens", 0))
            if kind == "decode":
                decode_requests += int(s.get("requests", 0))
                decode_matched += 1
        if before is not None:
            gap = max(0.0, float(x["t"]) - float(x["span_s"]) - float(before["t"]))
            sched = min(gap, sum(_hook_s(s).values())) if s is not None else 0.0
            out["connector_scheduler_s"] += sched
            rest = gap - sched
            out["paused_s" if rest >= IDLE_GAP_S else "between_steps_s"] += rest
        before = x
    out["decode_batch"] = decode_requests / decode_matched if decode_matched else 0.0
    out["worker_files"] = files
    return out


def summarize_profile(directory: Path, since: float | None = None, until: float | None = None
                      ) -> dict[str, object]:
    """``{kind: {...figures...}}`` for the steps between ``since`` and ``until`` (the run's
    requests, ``time.monotonic()``: a warm-up before them is left out; None: every step) that
    the lines in ``directory`` record, one worker's (:func:`_worker_lines`; see the module
    docstring), and ``engine`` (:func:`engine_time`) when the lines carry their time; ``{}``
    when there are none."""
    scheduler = _scheduler_lines(directory)
    lines, files = _worker_lines(directory, since, until)
    workers = [x for x in lines if int(x.get("step", 0)) > 0]
    out: dict[str, object] = {}
    for kind in KINDS:
        if kind == "decode, nothing moved":
            steps = [(w, _scheduler_of(w, scheduler)) for w in workers
                     if w.get("kind") == "decode" and not _moved(w)]
        else:
            steps = [(w, _scheduler_of(w, scheduler)) for w in workers if w.get("kind") == kind]
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
    engine = _engine(lines, files, scheduler) if out else None
    if engine is not None:
        out["engine"] = engine
    return out
