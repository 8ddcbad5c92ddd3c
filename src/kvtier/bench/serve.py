"""``kvtier bench serve``: a multi-turn serving benchmark on real ShareGPT conversations, vLLM
alone against vLLM with kvtier and against kvtier's peers, one after the other on the same
machine, repeated interleaved (A B C A B C ...).

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
  DRAM for ``host_fraction`` of the workload's KV, SSD for all of it;
- peers (``peers``): ``lmcache`` -- LMCache (:mod:`kvtier.bench.peers.lmcache`, in an
  environment of its own), kvtier's DRAM and SSD budgets, chunk ``chunk_tokens``;
  ``lmcache-decode`` -- the same with ``save_decode_cache`` (its chat setting); ``offload`` --
  vLLM's own OffloadingConnector with kvtier's DRAM budget, where the platform supports it
  (where it refuses to start, the report says so with its error).

``repeats`` runs every configuration that many times, interleaved; each figure is reported per
run and as the median and range over the runs, computed over the requests every run of every
configuration completed (matched by conversation and turn). ``profile`` wraps each connector in
the timing proxy (:mod:`kvtier.bench.peers.connector_profile`) and reports its per-step table
(:mod:`kvtier.bench.peers.profile_report`). ``instances`` > 1 serves each configuration
(``vllm`` and ``kvtier`` only) by that many instances behind a router, ``route`` ``sticky`` or
``round-robin``, kvtier's daemons sharing a remote tier (:mod:`kvtier.bench.serve_fleet`).

Per configuration: TTFT of first and of later turns, TPOT, requests/s, for later turns the
tokens vLLM computed beyond the turn's new tokens (new = this prompt - previous prompt -
previous reply; computed = prompt - cached), the daemon's hits per tier, and whether every
reply equals the ``vllm`` configuration's.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from kvtier.bench.chat_client import run_conversations, warm_up
from kvtier.bench.serve_config import ServeBenchConfig
from kvtier.bench.serve_report import ConfigResult, Run, ServeBenchReport, build_report, summarize
from kvtier.bench.serve_stacks import (
    _POOL_LOG,
    SERVED_NAME,
    RequestFailed,
    _kvtier_delta,
    cpu_s,
    preemptions,
    request_loads,
    stack_config,
)
from kvtier.bench.serve_workload import Workload, build_workload
from kvtier.demo import resolve_model
from kvtier.launch import ChildDied, ServeStack, StackConfig

__all__ = ["ConfigResult", "ServeBenchReport", "run_serve_bench", "summarize"]


def _run_one(name: str, repeat: int, stack_cfg: StackConfig, config: ServeBenchConfig, work: Workload,
             progress: Callable[[str], None]) -> Run:
    progress(f"{name} (run {repeat + 1} of {config.repeats}): starting vLLM"
             f"{' and the kvtier daemon' if stack_cfg.store else ''}")
    with ServeStack(stack_cfg) as stack:
        url = f"{stack.url}/v1"
        try:
            warm_up(url, SERVED_NAME)
            before = stack.stats() if stack.socket else None
            preempted = preemptions(stack.url)
            cpu0 = {child: cpu_s(stack, child) for child in ("daemon", "vllm")}
            t0, since = time.perf_counter(), time.monotonic()  # (the profile's clock: time.monotonic)
            if work.trace is not None:
                from kvtier.bench.serve_trace import run_trace

                trace = work.trace
                progress(f"{name}: {len(trace.prompts)} trace requests")
                records = trace.turn_records(run_trace(url, SERVED_NAME, trace.prompts, trace.outputs,
                                                       trace.arrivals_s))
            else:
                progress(f"{name}: {len(work.plans)} conversations of {config.turns} turns")
                records = run_conversations(url, SERVED_NAME, work.plans, in_flight=config.in_flight,
                                            think_s=config.think_s, hints=config.hints and name == "kvtier")
            wall, until = time.perf_counter() - t0, time.monotonic()
            cpu = {child: (None if cpu0[child] is None or (now := cpu_s(stack, child)) is None else now - cpu0[child])
                   for child in cpu0}
            loads = request_loads(stack, len(records) if work.trace is not None else len(work.plans)) \
                if stack.socket else None
        except Exception as exc:  # the server's log says why; it goes with the stack
            raise RequestFailed(f"{name}: a request failed ({exc}); the end of vLLM's log:\n"
                                f"{stack.log_text('vllm')[-4000:]}") from exc
        stack.check()
        after = preemptions(stack.url)
        preempted = after - preempted if after is not None and preempted is not None else None
        delta = _kvtier_delta(before, stack.stats()) if before is not None else None
        found = _POOL_LOG.findall(stack.log_text("vllm"))
        pool = int(found[-1].replace(",", "")) if found else None
    profile = None
    if stack_cfg.vllm.profile_dir is not None:
        from kvtier.bench.peers.profile_report import summarize_profile

        profile = summarize_profile(Path(stack_cfg.vllm.profile_dir), since, until)
    return Run(name, repeat, records, wall, pool, delta, profile, preempted, loads=loads, cpu_s=cpu)


_ERROR_LINE = re.compile(r"^.*\b(?:[A-Za-z]*Error|Exception): .*$", re.MULTILINE)


_RAISED_LINE = re.compile(r"^(?:\(\w+ pid=\d+\)\s+)?(?:[\w.]*Error|[\w.]*Exception): .*$", re.MULTILINE)
_WRAPPER = re.compile(r"initialization failed|See root cause above|Failed core proc")


def refusal(log_tail: str) -> str:
    """The line of a server's log that says why it would not start (its first error line that
    is not the engine's own "initialization failed ... see root cause above": the root cause)."""
    raised = _RAISED_LINE.findall(log_tail)  # an exception's own line, not a warning naming one
    found = raised or _ERROR_LINE.findall(log_tail)
    lines = [x for x in found if not _WRAPPER.search(x)] or found
    return (lines[0] if lines else log_tail.strip().splitlines()[-1] if log_tail.strip() else "?").strip()[:500]


def run_serve_bench(config: ServeBenchConfig, progress: Callable[[str], None] = lambda _m: None
                    ) -> ServeBenchReport:
    model_dir = resolve_model(config.model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = build_workload(config, model_dir)
    lmcache_py = None
    if any(p.startswith("lmcache") for p in config.peers):
        from kvtier.bench.peers.lmcache import lmcache_python

        lmcache_py = lmcache_python(Path(config.cache_dir) if config.cache_dir else None,
                                    config.lmcache_python, progress)
    runs: list[Run] = []
    refused: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-", dir=config.directory) as tmpdir:
        for repeat in range(config.repeats):
            for name in config.names:
                if name in refused:
                    continue
                tmp = Path(tmpdir) / f"run{repeat}"
                profile_dir = tmp / f"{name}-profile" if config.profile else None
                if config.instances > 1:
                    from kvtier.bench.serve_fleet import run_fleet

                    runs.append(run_fleet(name, repeat, config, model_dir, work, tmp, profile_dir, progress))
                    shutil.rmtree(tmp / name, ignore_errors=True)
                    continue
                stack_cfg = stack_config(name, config, model_dir, work, tmp, lmcache_py, profile_dir)
                try:
                    runs.append(_run_one(name, repeat, stack_cfg, config, work, progress))
                except ChildDied as exc:
                    if name != "offload":
                        raise
                    log_file = Path(stack_cfg.workdir) / "vllm.log"  # (the whole log: the root
                    text = log_file.read_text(errors="replace") if log_file.exists() else exc.log_tail
                    refused[name] = refusal(text)  # cause may lie before the tail's traceback)
                    progress(f"{name}: vLLM refused to start: {refused[name]}")
                shutil.rmtree(tmp / name, ignore_errors=True)  # its SSD files: the next run's disk
    notes = []
    if lmcache_py is not None:
        notes.append("LMCache ran through kvtier.bench.peers.lmcache_cpu: LMCache 0.5.6 ships no CPU "
                     "paged-KV copier for vLLM's CPU backend, and that adapter supplies one (it only "
                     "moves bytes)")
    if config.instances > 1:
        from kvtier.bench.serve_routes import cpu_binds

        binds = cpu_binds(config.cpu_bind, config.instances)
        notes.append(f"{config.instances} vLLM instances per configuration, {config.route} routing; "
                     "VLLM_CPU_OMP_THREADS_BIND " + ", ".join(f"instance {i}: {b}" for i, b in enumerate(binds))
                     + " in every configuration; kvtier: a daemon per instance with the DRAM and SSD "
                       "budgets of one, all sharing one Valkey remote tier (write-through)")
    workload = {"conversations": work.ids, "final_tokens": work.final_tokens,
                "kv_bytes_per_token": work.kv_bytes_per_token, "kv_bytes": work.kv_bytes,
                "shared_tokens": work.shared_tokens, "kind": "trace" if work.trace is not None else config.workload}
    if work.trace is not None:
        workload["trace"] = work.trace.description
    settings = asdict(config)
    if config.instances == 1:  # a single instance's report stays as it was before fleets
        del settings["instances"], settings["route"]
    return build_report(settings, workload, runs, refused, notes, work.shared_tokens,
                        work.trace.history_tokens() if work.trace is not None else None)
