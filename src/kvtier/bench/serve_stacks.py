"""One configuration of ``kvtier bench serve`` as a server stack (:mod:`kvtier.bench.serve`): the
vLLM flags every configuration shares, the cache budgets, kvtier's or a peer's connector, and
what the stack counts over a run (the daemon's counters, vLLM's preemptions)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from kvtier.bench.serve_config import ServeBenchConfig
from kvtier.bench.serve_workload import Workload
from kvtier.bench.servers import free_port
from kvtier.launch import PROFILE_MODULE, ServeStack, StackConfig, StoreSpec, VLLMSpec

__all__ = ["SERVED_NAME", "RequestFailed", "budgets", "cpu_s", "preemptions", "request_loads", "stack_config"]


class RequestFailed(RuntimeError):
    """A turn failed: the benchmark has no meaning without it (the message ends with vLLM's log)."""


SERVED_NAME = "bench"
_POOL_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


def _kvtier_delta(before: dict, after: dict) -> dict[str, int]:  # type: ignore[type-arg]
    out: dict[str, int] = {}
    for tier in after["tiers"]:
        out[f"{tier}_hits"] = after["tiers"][tier]["hits"] - before["tiers"][tier]["hits"]
        out[f"{tier}_tokens_taken"] = (after["loaded_tokens"].get(tier, 0)
                                       - before["loaded_tokens"].get(tier, 0))
    for key in ("lookups", "hit_tokens", "saved_chunks", "promotions", "demotions",
                "engine_load_failures"):
        out[key] = int(after.get(key, 0)) - int(before.get(key, 0))
    return out


def budgets(config: ServeBenchConfig, work: Workload) -> tuple[int, int]:
    """(DRAM bytes, SSD bytes) every cache configuration gets: kvtier's and its peers' alike."""
    chunk_bytes = config.chunk_tokens * work.kv_bytes_per_token
    return (max(4 * chunk_bytes, int(config.host_fraction * work.kv_bytes)),
            2 * work.kv_bytes + 16 * chunk_bytes)


def stack_config(name: str, config: ServeBenchConfig, model_dir: Path, work: Workload, tmp: Path,
                 lmcache_python: Path | None = None, profile_dir: Path | None = None) -> StackConfig:
    """The same vLLM flags for every configuration; ``kvtier`` adds the daemon, a peer its
    connector (``lmcache_python``: the peer's environment)."""
    longest = max(work.final_tokens)
    max_len = -(-(longest + config.block_size) // config.block_size) * config.block_size
    blocks = math.ceil(config.pool_conversations * max_len / config.block_size) + 1  # + vLLM's null block
    pool_gib = math.ceil(2 * blocks * config.block_size * work.kv_bytes_per_token / (1 << 30))
    args = ("--dtype", "float32", "--enforce-eager", "--seed", "0", "--block-size", str(config.block_size),
            "--max-model-len", str(max_len), "--num-gpu-blocks-override", str(blocks),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--served-model-name", SERVED_NAME)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": config.cpu_bind,
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, pool_gib))}  # an upper bound; the override decides
    dram, ssd = budgets(config, work)
    store = connector = python = None
    module = PROFILE_MODULE
    run = tmp / name
    if name == "kvtier":
        store = StoreSpec(host_bytes=dram, disk_path=str(run / "ssd"), disk_bytes=ssd, policy=config.policy)
    elif name in ("lmcache", "lmcache-decode"):
        from kvtier.bench.peers.lmcache import lmcache_config, lmcache_server

        if lmcache_python is None:
            raise ValueError(f"bench serve {name} needs LMCache's environment")
        run.mkdir(parents=True, exist_ok=True)
        path = lmcache_config(run / "lmcache.yaml", dram_bytes=dram, disk_path=run / "disk",
                              disk_bytes=ssd, chunk_tokens=config.chunk_tokens,
                              save_decode=name == "lmcache-decode")
        connector, more = lmcache_server(path)
        env = {**env, **more}
        python, module = str(lmcache_python), "connector_profile"
    elif name == "offload":
        connector = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"cpu_bytes_to_use": dram, "offload_prompt_only": False}}
    return StackConfig(vllm=VLLMSpec(model=str(model_dir), port=free_port(), args=args, env=env,
                                     chunk_tokens=config.chunk_tokens, load_async=config.load_async,
                                     python=python, connector=connector, profile_module=module,
                                     profile_dir=str(profile_dir) if profile_dir and name != "vllm" else None),
                       store=store, workdir=str(run))


def request_loads(stack: ServeStack, conversations: int) -> dict[str, dict[str, object]]:
    """The stack's daemon's per-request load log (:meth:`StoreClient.request_loads`) for the
    benchmark's requests (``kvtb-<conversation>-...``), a conversation a call."""
    from kvtier.server.client import StoreClient

    assert stack.socket is not None
    client = StoreClient(stack.socket, timeout_s=10.0, retry_s=0.05)
    out: dict[str, dict[str, object]] = {}
    try:
        for c in range(conversations):
            out.update(client.request_loads(f"kvtb-{c}-", limit=4096))
    finally:
        client.close()
    return out


def cpu_s(stack: ServeStack, name: str) -> float | None:
    """CPU seconds (user + system) the stack's ``daemon`` or ``vllm`` and its children used so
    far (None: not running)."""
    import psutil

    child = {"daemon": stack.daemon, "vllm": stack.vllm}[name]
    if child is None or child.poll() is not None:
        return None
    try:
        top = psutil.Process(child.pid)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # (a child that ended meanwhile)
            pass
    return total


_PREEMPTIONS = re.compile(r"^vllm:num_preemptions(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


def preemptions(base_url: str) -> int | None:
    """vLLM's count of preempted requests so far (its ``/metrics``); None if it cannot say."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    found = _PREEMPTIONS.findall(text)
    return int(sum(float(x) for x in found)) if found else None
