"""``kvtier bench stall``: what a stalled daemon costs vLLM's engine loop.

A real ``kvtier store serve`` process and vLLM's in-process engine (float32, eager) with the
connector. ``requests`` requests decode (``decode_tokens`` each, so chunks keep completing and
saving); ``stop_at_s`` into the run the daemon is SIGSTOPped for ``stop_s`` seconds, and
``arrivals`` new requests whose prompts share a history the daemon holds arrive during the stop
(each a lookup). Every engine step is timed (``EngineCore.step``: schedule, the forward pass
with the connector's hooks, the outputs). The figures: the longest step and the median step
before, during and after the stop, and the hits of a request that arrives after the stop (the
daemon serves again). On an engine whose connector waited on the daemon, the longest step was
the daemon's stop, or its client's 5 s timeout.
"""

from __future__ import annotations

import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.demo import resolve_model


@dataclass(frozen=True)
class StallConfig:
    model: str = "tiny"
    requests: int = 4
    decode_tokens: int = 4000
    prompt_tokens: int = 300
    stop_at_s: float = 2.0
    stop_s: float = 8.0
    arrivals: int = 4
    chunk_tokens: int = 64
    block_size: int = 32
    wait_ms: float = 20.0

    def __post_init__(self) -> None:
        if self.chunk_tokens % self.block_size:
            raise ValueError("chunk_tokens must be a multiple of block_size")
        for name in ("requests", "decode_tokens", "prompt_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.stop_s <= 0 or self.stop_at_s < 0 or self.arrivals < 0:
            raise ValueError("stop_s must be positive, stop_at_s and arrivals >= 0")


@dataclass
class StallResult:
    steps: int
    """Engine steps that produced tokens."""
    steps_during_stop: int
    longest_step_s: float
    longest_step_during_stop_s: float
    median_step_before_s: float
    median_step_during_stop_s: float
    median_step_after_s: float
    stop_s: float
    tokens_during_stop: int
    """Tokens the running requests decoded while the daemon was stopped."""
    hit_tokens_after: int
    """Tokens a request arriving after the stop loaded from kvtier (its prompt's history)."""
    lookups_missed: int
    """Lookups the scheduler gave up on (the daemon did not answer in time)."""
    step_times: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out.pop("step_times")
        return out


def _prompt(n: int, salt: int) -> list[int]:
    return [6 + (i * 7 + salt * 13 + i // 11) % 90 for i in range(n)]


def _daemon(work: Path) -> subprocess.Popen:
    cfg = work / "kvtier.toml"
    cfg.write_text("\n".join([
        f'socket = "{work / "kv.sock"}"', "write_through = true",
        "[host]", 'capacity_bytes = "256MiB"',
        "[disk]", f'path = "{work / "ssd"}"', 'capacity_bytes = "1GiB"',
    ]) + "\n")
    kvtier = str(Path(sys.executable).with_name("kvtier"))
    log = open(work / "daemon.log", "a")  # noqa: SIM115 - the daemon's stderr for its life
    proc = subprocess.Popen([kvtier, "store", "serve", "--config", str(cfg)], stderr=log)
    deadline = time.monotonic() + 60
    while not (work / "kv.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the daemon did not start: {(work / 'daemon.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def _stopped(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    status = Path(f"/proc/{pid}/status")
    deadline = time.monotonic() + 10
    while "T (stopped)" not in status.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon did not stop")
        time.sleep(0.002)


def run_stall(config: StallConfig) -> StallResult:
    """Run it (needs ``vllm``; its in-process engine runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    the environment restored after)."""
    saved = dict(os.environ)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    try:
        return _run(config)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run(config: StallConfig) -> StallResult:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvtier.engines.vllm.offline import drain

    model_dir = resolve_model(config.model)
    with tempfile.TemporaryDirectory(prefix="kvtier-stall-") as tmp:
        work = Path(tmp)
        proc = _daemon(work)
        llm = None
        try:
            ktc = KVTransferConfig(
                kv_connector="KVTierConnector", kv_connector_module_path="kvtier.engines.vllm",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"socket": str(work / "kv.sock"), "chunk_tokens": config.chunk_tokens,
                                           "wait_ms": config.wait_ms, "retry_s": 0.2})
            llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, block_size=config.block_size,
                      max_model_len=config.prompt_tokens + config.decode_tokens + 64, seed=0,
                      enable_prefix_caching=False, kv_transfer_config=ktc)
            history = _prompt(config.prompt_tokens, 1)
            short = SamplingParams(temperature=0.0, max_tokens=4)
            llm.generate([{"prompt_token_ids": history}], short, use_tqdm=False)  # the daemon holds it
            drain(llm)
            engine = llm.llm_engine
            core = engine.engine_core.engine_core
            long = SamplingParams(temperature=0.0, max_tokens=config.decode_tokens, ignore_eos=True)
            for i in range(config.requests):
                engine.add_request(f"decode-{i}", {"prompt_token_ids": _prompt(config.prompt_tokens, 100 + i)}, long)
            arrivals = [config.stop_at_s + (k + 0.5) * config.stop_s / max(1, config.arrivals)
                        for k in range(config.arrivals)]
            follow = [*history, *_prompt(40, 7)]
            times: list[tuple[float, float, int]] = []  # (start, seconds, tokens decoded)
            t0 = time.monotonic()
            stopped_at = resumed_at = None
            done = False
            while not done:
                now = time.monotonic() - t0
                if stopped_at is None and now >= config.stop_at_s:
                    _stopped(proc.pid)
                    stopped_at = now
                if stopped_at is not None and resumed_at is None and now >= stopped_at + config.stop_s:
                    os.kill(proc.pid, signal.SIGCONT)
                    resumed_at = now
                while arrivals and now >= arrivals[0]:
                    arrivals.pop(0)
                    engine.add_request(f"arrival-{len(times)}", {"prompt_token_ids": follow}, short)
                start = time.monotonic()
                outputs = engine.step()
                elapsed = time.monotonic() - start
                times.append((start - t0, elapsed, len(outputs)))
                done = resumed_at is not None and time.monotonic() - t0 > resumed_at + 2.0
            engine.abort_request([f"decode-{i}" for i in range(config.requests)])
            while engine.has_unfinished_requests():
                engine.step()
            drain(llm)
            before_hits = _hit_tokens(work)
            llm.generate([{"prompt_token_ids": [*history, *_prompt(40, 9)]}], short, use_tqdm=False)
            hits_after = _hit_tokens(work) - before_hits
            missed = int(getattr(core.scheduler.connector.scheduler, "lookups_missed", 0))
        finally:
            if llm is not None:
                del llm
                gc.collect()
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.terminate()
            proc.wait(timeout=30)
    assert stopped_at is not None and resumed_at is not None
    times = [t for t in times if t[2]]  # steps that produced tokens (not the idle loop's)
    during = [t for t in times if stopped_at <= t[0] < resumed_at]
    before = [t for t in times if t[0] < stopped_at]
    after = [t for t in times if t[0] >= resumed_at]

    def median(ts: list[tuple[float, float, int]]) -> float:
        return statistics.median(t[1] for t in ts) if ts else 0.0

    return StallResult(
        steps=len(times), steps_during_stop=len(during),
        longest_step_s=max(t[1] for t in times),
        longest_step_during_stop_s=max((t[1] for t in during), default=0.0),
        median_step_before_s=median(before), median_step_during_stop_s=median(during),
        median_step_after_s=median(after), stop_s=resumed_at - stopped_at,
        tokens_during_stop=sum(t[2] for t in during), hit_tokens_after=hits_after,
        lookups_missed=missed, step_times=[t[1] for t in times],
    )


def _hit_tokens(work: Path) -> int:
    from kvtier.server.client import StoreClient

    client = StoreClient(str(work / "kv.sock"))
    try:
        return int(client.stats()["hit_tokens"])  # type: ignore[call-overload]
    finally:
        client.close()
