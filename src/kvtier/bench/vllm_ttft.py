"""Time to first token through vLLM: a follow-up turn after a long history, three ways, in one
process (vLLM's in-process engine, float32, eager):

- ``vllm``: vLLM alone, its own prefix cache off -- what happens when its pool is too small to
  have kept the history: the whole prompt is prefilled;
- ``dram``: vLLM + kvtier, the history's KV in the daemon's DRAM tier;
- ``ssd``: vLLM + kvtier after a daemon restart: DRAM empty, the history on SSD only.

TTFT is the time of a generation of one token (prefill plus one sampling step); each figure is
the median of ``repeats`` runs. Every kvtier run must produce vLLM's own token.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

from kvtier.demo import resolve_model


@dataclass(frozen=True)
class VLLMTTFTConfig:
    model: str = "small"
    history_tokens: int = 4096
    new_tokens: int = 128
    chunk_tokens: int = 256
    block_size: int = 32
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.chunk_tokens % self.block_size:
            raise ValueError("chunk_tokens must be a multiple of block_size")
        if self.history_tokens < self.chunk_tokens or self.new_tokens <= 0 or self.repeats <= 0:
            raise ValueError("history must hold a chunk; new_tokens and repeats must be positive")


@dataclass(frozen=True, slots=True)
class VLLMTTFTResult:
    history_tokens: int
    new_tokens: int
    ttft_vllm_s: float
    ttft_dram_s: float
    ttft_ssd_s: float
    dram_ratio: float
    ssd_ratio: float
    dram_hits: int
    ssd_hits: int
    same_output: bool

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _saved(engine, daemon, chunks: int, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Wait until the history's chunks are stored: ``generate`` returns before a finished
    request's last chunks are saved, and the worker's commits are not waited for in its step, so
    a request timed at once could find part of the history still being committed."""
    from kvtier.engines.vllm.offline import drain

    drain(engine)
    deadline = time.monotonic() + timeout_s
    while int(daemon.snapshot()["tiers"]["host"]["chunks"]) < chunks:  # type: ignore[index]
        if time.monotonic() > deadline:
            raise RuntimeError(f"the history's {chunks} chunks were not stored within {timeout_s:g} s")
        time.sleep(0.01)


def run_vllm_ttft(config: VLLMTTFTConfig) -> VLLMTTFTResult:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM logs to stdout otherwise
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvtier.engines.hf import kv_layout_for
    from kvtier.engines.vllm_chat import daemon_cache
    from kvtier.server.daemon import DaemonConfig, StoreDaemon
    from kvtier.store import StoreConfig
    from kvtier.tiers.disk_config import DiskTierConfig
    from kvtier.tiers.host_config import HostTierConfig

    model_dir = resolve_model(config.model)
    layout = kv_layout_for(AutoConfig.from_pretrained(model_dir), config.chunk_tokens)
    total = config.history_tokens + config.new_tokens
    prompt = [7 + (i * 31 + i // 97) % 90 for i in range(total)]
    history = prompt[: config.history_tokens] + [5]
    sp = SamplingParams(temperature=0.0, max_tokens=1)

    def llm(connector: KVTransferConfig | None):  # type: ignore[no-untyped-def]
        return LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=0,
                   max_model_len=total + 64, block_size=config.block_size,
                   enable_prefix_caching=False, kv_transfer_config=connector)

    def timed(engine) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = engine.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
        return time.perf_counter() - start, list(out.token_ids)

    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-ttft-") as work:
        store = StoreConfig(
            model="vllm-ttft", layout=layout, host=HostTierConfig(layout.bytes_for_tokens(2 * total) + (64 << 20)),
            disk=DiskTierConfig(os.path.join(work, "ssd"), layout.bytes_for_tokens(4 * total) + (64 << 20)),
            write_through=True,
        )
        daemon_cfg = DaemonConfig(os.path.join(work, "kv.sock"), daemon_cache(store))
        daemon = StoreDaemon(daemon_cfg).start()
        try:
            alone = llm(None)
            timed(alone)  # warm-up
            base = [timed(alone) for _ in range(config.repeats)]
            del alone
            gc.collect()
            ktc = KVTransferConfig(
                kv_connector="KVTierConnector", kv_connector_module_path="kvtier.engines.vllm",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"socket": daemon_cfg.socket_path, "retry_s": 0.01,
                                           "chunk_tokens": config.chunk_tokens},
            )
            engine = llm(ktc)
            engine.generate([{"prompt_token_ids": history}], sp, use_tqdm=False)  # saves the history
            _saved(engine, daemon, len(history) // config.chunk_tokens)
            dram = [timed(engine) for _ in range(config.repeats)]
            dram_hits = int(daemon.snapshot()["hit_tokens"])  # type: ignore[call-overload]
            ssd = []
            ssd_hits = 0
            for _ in range(config.repeats):
                daemon.stop()  # DRAM is gone; SSD keeps what was written through
                daemon = StoreDaemon(dataclasses.replace(daemon_cfg)).start()
                ssd.append(timed(engine))
                ssd_hits += int(daemon.snapshot()["hit_tokens"])  # type: ignore[call-overload]
            del engine
            gc.collect()
        finally:
            daemon.stop()
    t_base = statistics.median(t for t, _ in base)
    t_dram = statistics.median(t for t, _ in dram)
    t_ssd = statistics.median(t for t, _ in ssd)
    ref = base[0][1]
    return VLLMTTFTResult(
        history_tokens=config.history_tokens, new_tokens=config.new_tokens,
        ttft_vllm_s=t_base, ttft_dram_s=t_dram, ttft_ssd_s=t_ssd,
        dram_ratio=t_dram / t_base, ssd_ratio=t_ssd / t_base,
        dram_hits=dram_hits, ssd_hits=ssd_hits,
        same_output=all(toks == ref for _, toks in base + dram + ssd),
    )
