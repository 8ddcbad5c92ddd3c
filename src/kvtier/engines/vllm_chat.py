"""The demo's engine over vLLM: an in-process vLLM engine with the kvtier connector in front of
a store daemon, its own prefix cache off (a pool too small to keep the conversations). The
baseline runs on the same engine with kvtier skipped for the request (vLLM allows one KV
connector per process). Same ``generate`` / ``wait_for_saves`` / ``close`` as HFEngine."""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.engines.chat_render import chat_prompt_ids
from kvtier.engines.hf import Message
from kvtier.engines.turn_result import TurnResult
from kvtier.server.daemon import DaemonConfig, StoreDaemon
from kvtier.store import StoreConfig
from kvtier.store.cache import CacheConfig
from kvtier.tiers.base import round_up

BLOCK = 32


def daemon_cache(store: StoreConfig) -> CacheConfig:
    """A daemon's cache with ``store``'s tiers and policy, its DRAM extents sized to the store's
    chunks (a daemon serves any model; this one serves the store's)."""
    host = dataclasses.replace(store.host, extent_bytes=round_up(store.layout.chunk_bytes))
    return CacheConfig(host=host, disk=store.disk, policy=store.policy, write_through=store.write_through)


class VLLMChat:
    def __init__(self, model_dir: Path, store: StoreConfig, max_new_tokens: int, max_model_len: int = 8192) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-vllm-")
        cache = daemon_cache(store)
        self.daemon = StoreDaemon(DaemonConfig(os.path.join(self._tmp.name, "kv.sock"), cache)).start()
        ktc = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.engines.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"socket": self.daemon.config.socket_path,
                                       "chunk_tokens": store.layout.chunk_tokens},
        )
        common = dict(model=str(model_dir), dtype="float32", enforce_eager=True, seed=0,
                      max_model_len=max_model_len, block_size=BLOCK, enable_prefix_caching=False,
                      disable_log_stats=False)
        self.llm = LLM(kv_transfer_config=ktc, **common)
        self.tokenizer = self.llm.get_tokenizer()
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=1)
        self.skip = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=1,
                                   extra_args={"kv_transfer_params": {"kvtier": "skip"}})

    def generate(self, messages: Sequence[Message], *, use_store: bool = True) -> TurnResult:
        ids = chat_prompt_ids(self.tokenizer, messages)
        before = self.daemon.snapshot()
        start = time.perf_counter()
        params = self.params if use_store else self.skip
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        after = self.daemon.snapshot()
        comp = out.outputs[0]
        ttft = getattr(out.metrics, "first_token_latency", 0.0) or elapsed
        hit = int(after["hit_tokens"]) - int(before["hit_tokens"]) if use_store else 0  # type: ignore[call-overload]
        up = int(after["promotions"]) - int(before["promotions"])  # type: ignore[call-overload]
        tier_tokens = {"disk": hit} if up else ({"host": hit} if hit else {})
        first = comp.logprobs[0][comp.token_ids[0]].logprob if comp.logprobs else 0.0
        return TurnResult(
            prompt_tokens=len(ids), hit_tokens=hit, tier=next(iter(tier_tokens), "-"),
            tier_tokens=tier_tokens, ttft_s=ttft, token_ids=list(comp.token_ids), text=comp.text,
            first_logits=torch.tensor([first]),
        )

    def wait_for_saves(self) -> None:
        """The connector saves a finished turn's last chunks in the background while vLLM keeps
        its blocks; step the engine until it has (the next turn finds the whole history)."""
        from kvtier.engines.vllm.offline import drain

        drain(self.llm)

    def close(self) -> None:
        del self.llm
        gc.collect()
        self.daemon.stop()
        self._tmp.cleanup()
