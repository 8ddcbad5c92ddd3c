"""kvtier as a vLLM V1 KV connector: to vLLM, a kvtier hit looks like a prefix-cache hit.

    kvtier serve MODEL_DIR --host-bytes 16GiB --disk-path /nvme/kvtier --disk-bytes 500GiB

starts a store daemon and vLLM's OpenAI server wired to it. By hand::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.engines.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/kvtier.sock"}}'

with a store daemon running (``kvtier store serve``; it needs no model). Both halves of the
connector -- the scheduler's (:mod:`.scheduler`, in vLLM's engine-core process) and the
worker's (:mod:`.worker`, next to the model) -- are clients of that daemon and name the same
namespace in their hello: the model's fingerprint and what vLLM decides on top of its files
(revision, effective HF config with ``hf_overrides``, quantization, dtype, KV cache dtype:
:mod:`.namespace`; extra config ``model_id`` overrides it), the KV layout vLLM's config implies in chunks of ``chunk_tokens``
(extra config, default 256, rounded up to whole vLLM blocks), and the page format (vLLM's
release, attention backend, the CPU attention ISA vLLM picks on this machine, KV dtype, block
size, tensor- and pipeline-parallel shard: :mod:`.pages`). A request's
``cache_salt`` is chained into its keys.

A daemon that is down, dies or restarts costs hits, never a request: lookups then miss, and
blocks whose load fails are reported to vLLM (``get_block_ids_with_load_errors``) to be
recomputed.
"""

from __future__ import annotations

import logging

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.core.layout import KVLayout
from kvtier.engines.vllm.events import DEFAULT_MAX_CHUNKS, KVEvents, Poller
from kvtier.engines.vllm.namespace import engine_model_id
from kvtier.engines.vllm.pages import adapter_for, engine_page_format
from kvtier.engines.vllm.plan import KVTierMetadata
from kvtier.engines.vllm.request_state import skipped
from kvtier.engines.vllm.scheduler import SchedulerSide
from kvtier.engines.vllm.stats import Deltas, KVTierPromMetrics, KVTierStats
from kvtier.engines.vllm.votes import check_executor, engine_ranks
from kvtier.engines.vllm.worker import WorkerSide
from kvtier.errors import DaemonUnavailable
from kvtier.server.client import StoreClient

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 256


def vllm_layout(vllm_config, chunk_tokens: int) -> KVLayout:  # type: ignore[no-untyped-def]
    """The KV layout of the model vLLM serves (this rank's shard), in chunks of ``chunk_tokens``."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    dtype = str(mc.dtype).removeprefix("torch.")
    if getattr(mc, "use_mla", False):  # one latent per token and layer
        return KVLayout(num_layers=mc.get_num_layers(pc), num_kv_heads=1, head_dim=mc.get_head_size(),
                        dtype=dtype, chunk_tokens=chunk_tokens, kv=1)
    return KVLayout(num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
                    head_dim=mc.get_head_size(), dtype=dtype, chunk_tokens=chunk_tokens)


def attention_backend(vllm_config) -> str:  # type: ignore[no-untyped-def]
    """The name of the attention backend vLLM selects for this model, as its layers do."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    mc = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(mc.get_head_size(), mc.dtype, vllm_config.cache_config.cache_dtype,
                                   use_mla=bool(getattr(mc, "use_mla", False)))
    return str(backend.get_name())


def _seconds(cfg, name: str, default: float) -> float:  # type: ignore[no-untyped-def]
    """A positive number from ``kv_connector_extra_config`` (ValueError naming it otherwise)."""
    value = cfg.get_from_extra_config(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"kv_connector_extra_config.{name} must be a positive number, got {value!r}")
    return float(value)


def _probe_or_raise(client: StoreClient):  # type: ignore[no-untyped-def]
    """``client.probe``, raising DaemonUnavailable where it would answer "not held" because the
    daemon could not be asked (KV events must tell the two apart)."""
    def probe(keys):  # type: ignore[no-untyped-def]
        before = client.errors
        got = client.probe(keys)
        if client.errors != before:
            raise DaemonUnavailable("the daemon did not answer a probe")
        return got

    return probe


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        if cfg.kv_load_failure_policy != "recompute":
            # kvtier is a cache: a chunk it cannot deliver (daemon gone, chunk damaged) must be
            # recomputed, never fail the request. vLLM's scheduler reads this right after
            # creating its connector, so setting it here takes effect; say so.
            log.info("kvtier: setting kv_load_failure_policy='recompute' (was %r)", cfg.kv_load_failure_policy)
            cfg.kv_load_failure_policy = "recompute"
        socket_path = cfg.get_from_extra_config("socket", None)
        self.block_size = vllm_config.cache_config.block_size
        chunk = int(cfg.get_from_extra_config("chunk_tokens", DEFAULT_CHUNK_TOKENS))
        chunk = -(-chunk // self.block_size) * self.block_size  # whole vLLM blocks
        self.layout = vllm_layout(vllm_config, chunk)
        self.model_id = cfg.get_from_extra_config("model_id", None) or engine_model_id(vllm_config)
        pc = vllm_config.parallel_config
        tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        # Each rank stores its own shard of every chunk under its own namespace; the scheduler
        # looks up rank 0's (a rank missing a chunk reports its blocks as load errors).
        check_executor(pc, tp_size * pp_size)
        tp_rank, pp_rank = engine_ranks(role == KVConnectorRole.WORKER, tp_size * pp_size)
        self.backend = attention_backend(vllm_config)
        # (vLLM's release, backend, CPU ISA, KV dtype, block size, shard: :mod:`.pages`; an engine
        # whose pages no format can name -- context parallel, run-time KV scales -- is refused)
        self.page_format = engine_page_format(vllm_config, self.backend, tp_rank, pp_rank)
        retry_s = _seconds(cfg, "retry_s", 1.0)
        wait_s = _seconds(cfg, "wait_ms", 20.0) / 1000
        load_wait_s = _seconds(cfg, "load_wait_ms", 1000.0) / 1000
        lookup_deadline_s = _seconds(cfg, "lookup_deadline_ms", 2000.0) / 1000
        daemon_uid = cfg.get_from_extra_config("daemon_uid", None)
        if daemon_uid is not None and (not isinstance(daemon_uid, int) or isinstance(daemon_uid, bool)):
            raise ValueError(f"kv_connector_extra_config.daemon_uid must be a user id, got {daemon_uid!r}")
        instance = str(getattr(cfg, "engine_id", "") or "")  # shared by the scheduler and its workers
        worker = role == KVConnectorRole.WORKER

        def client(**kw: object) -> StoreClient:
            return StoreClient(str(socket_path) if socket_path else None, model=self.model_id,
                               layout=self.layout, page_format=self.page_format, retry_s=retry_s,
                               instance=instance or None, daemon_uid=daemon_uid,
                               map_arena=worker, **kw)  # the scheduler reads no chunk: it maps nothing

        # the step's calls: the daemon answers an acquire within half of what the step waits
        self.client = client(budget_s=load_wait_s / 2) if worker else client()
        self._other = client()  # hints (scheduler) / background saves (worker): their own connection
        self._role = role
        self._deltas = Deltas()
        self._events_client: StoreClient | None = None
        self._poller: Poller | None = None
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.WORKER:
            try:
                adapter = adapter_for(self.backend)
            except ValueError as exc:
                log.error("kvtier: %s; disabled", exc)
                adapter = None
            # every rank whose KV a chunk depends on votes before any commits (:mod:`.votes`)
            self.worker = WorkerSide(self.client, self._other, self.layout, self.block_size, adapter,
                                     ranks=tp_size * pp_size, wait_s=wait_s, load_wait_s=load_wait_s,
                                     log_loads=tp_rank == 0 and pp_rank == 0)
        else:
            load_async = cfg.get_from_extra_config("load_async", False)
            if not isinstance(load_async, bool):
                raise ValueError(f"kv_connector_extra_config.load_async must be true or false, got {load_async!r}")
            self.scheduler = SchedulerSide(self.client, self._other, self.block_size, load_async,
                                           wait_s=wait_s, lookup_deadline_s=lookup_deadline_s,
                                           ranks=tp_size * pp_size)
            self.scheduler.hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0) or self.block_size)
            kec = getattr(vllm_config, "kv_events_config", None)
            if kec is not None and kec.enable_kv_cache_events:
                # (vLLM asks for events whether it publishes or not: without, they stay inert)
                max_chunks = cfg.get_from_extra_config("events_max_chunks", DEFAULT_MAX_CHUNKS)
                if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
                    raise ValueError(f"kv_connector_extra_config.events_max_chunks must be a positive integer, "
                                     f"got {max_chunks!r}")
                self._events_client = client()  # its probes never wait behind the hints
                self.scheduler.events = KVEvents(_probe_or_raise(self._events_client), max_chunks)
                self._poller = Poller(self.scheduler.events, _seconds(cfg, "events_poll_ms", 500.0) / 1000)

    def profile_counters(self) -> dict[str, float]:
        """Cumulative counts for a profile (:mod:`kvtier.bench.peers.connector_profile`): daemon
        round trips on the connection of the step's calls (lookups; acquire, release, reserve,
        commit) and on the background one (hints; saves of finished requests, loads between
        steps), their seconds; the times vLLM's engine loop blocked on one of the step's calls
        (``loop_waits``) and for how long; and the bytes copied between the arena and vLLM's
        blocks."""
        n, s = self.client.round_trips
        bn, bs = self._other.round_trips
        side = self.worker if self.worker is not None else self.scheduler
        calls = side._calls if side is not None else None
        out: dict[str, float] = {"round_trips": n, "round_trip_s": s,
                                 "background_round_trips": bn, "background_round_trip_s": bs,
                                 "loop_waits": calls.waits if calls else 0,
                                 "loop_wait_s": calls.wait_s if calls else 0.0}
        copier = self.worker._copier if self.worker is not None else None
        if copier is not None:
            out.update(loaded_bytes=copier.loaded_bytes + copier.loaded_bg_bytes,
                       saved_bytes=copier.saved_bytes + copier.saved_bg_bytes)
        return out

    # ==================================================================== scheduler side
    def _sched(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler-side call in a worker"
        return self.scheduler

    def on_new_request(self, request) -> None:  # type: ignore[no-untyped-def]
        self._sched().on_new_request(request)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:  # type: ignore[no-untyped-def]
        if self.scheduler is not None:  # (whether a waiting request fits: worth a short wait)
            self.scheduler.block_pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:  # type: ignore[no-untyped-def]
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request) -> bool:  # type: ignore[no-untyped-def]
        """Whether the request may load between steps (vLLM 0.34+; its in-flight load limit
        counts it): with extra config ``load_async``, a request of a block or more not opted
        out. The lookup sent on arrival is not back when vLLM asks: a miss then holds other
        async loads back one step, as vLLM's docs say a false positive does."""
        return (self.scheduler is not None and self.scheduler.load_async and not skipped(request)
                and len(request.all_token_ids) > self.block_size)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:  # type: ignore[no-untyped-def]
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):  # type: ignore[no-untyped-def]
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        named = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
        out: dict = {}
        for tier, n in self._sched().hit_sources(request, num_external_tokens).items():
            source = named.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            if n:
                out[source] = out.get(source, 0) + n
        return out

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:  # type: ignore[no-untyped-def]
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:  # type: ignore[no-untyped-def]
        return self._sched().request_finished(request, list(block_ids)), None

    def update_connector_output(self, connector_output) -> None:  # type: ignore[no-untyped-def]
        self._sched().update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        """Votes or verdicts of an engine of several ranks still on their way: vLLM steps on
        until they arrive (:mod:`.votes`)."""
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def take_events(self):  # type: ignore[no-untyped-def]
        """KV events of what kvtier can load (:mod:`.events`), when vLLM publishes them."""
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        """vLLM reset its prefix cache (new weights): no chunk saved before is loaded again
        (:meth:`SchedulerSide.reset_cache`)."""
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    # ============================================================================== metrics
    def get_kv_connector_stats(self) -> KVTierStats | None:
        """What changed in this half's counts since vLLM last asked (None: nothing)."""
        if self.scheduler is not None:
            counts, gauges = self.scheduler.counters()
            return self._deltas.since_last(counts, gauges)
        if self.worker is not None:
            return self._deltas.since_last(self.worker.counters())
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVTierStats:  # type: ignore[type-arg]
        return KVTierStats(data=dict(data)) if data is not None else KVTierStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # type: ignore[no-untyped-def]
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:  # type: ignore[type-arg]
        return True  # its per-layer hooks must run: a full CUDA graph replay would skip them

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: vLLM never waits for it to deliver

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:  # type: ignore[no-untyped-def]
        return True  # (vLLM 0.33+) the worker half lets go of the KV cache: unregister_kv_caches

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):  # type: ignore[no-untyped-def]
        """(vLLM 0.34+) In process: kvtier's workers gather and scatter pages with torch
        (:mod:`.pages`) to and from host memory; nothing registers, exports or shares vLLM's KV
        memory, so any allocation serves (the extensible KV cache included)."""
        from vllm.config.kv_transfer import KVCacheAccess  # (0.34+, the only versions that ask)

        return KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config) -> bool:  # type: ignore[no-untyped-def]
        return False  # (vLLM 0.34+) kvtier's keys and KV events hash a block's own tokens only

    # ======================================================================= worker side
    def _work(self) -> WorkerSide:
        assert self.worker is not None, "a worker-side call in the scheduler"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        problem = None
        layers = getattr(self._vllm_config.compilation_config, "static_forward_context", {}) or {}
        for name in kv_caches:
            layer = layers.get(name)
            real = layer.get_attn_backend().get_name() if hasattr(layer, "get_attn_backend") else None
            if real is not None and real != self.backend:
                problem = (f"layer {name} runs attention backend {real}, not {self.backend} "
                           "(the page format the scheduler's keys name)")
                break
        self._work().register(kv_caches, num_blocks, problem)

    def unregister_kv_caches(self) -> None:
        """vLLM frees the KV cache's memory (sleep; vLLM 0.33+): copies drained, then every load
        misses and nothing is saved until ``restore_kv_caches`` (:mod:`.sleep`). Idempotent."""
        if self.worker is not None:
            self.worker.unregister()

    def restore_kv_caches(self) -> None:
        """The KV cache is backed again (wake-up; vLLM 0.33+). Idempotent."""
        if self.worker is not None:
            self.worker.restore()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self._work().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self._work().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._work().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished(finished_req_ids)

    def build_connector_worker_meta(self):  # type: ignore[no-untyped-def]
        return self._work().take_meta()

    def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.close()
        if self._events_client is not None:
            self._events_client.close()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.close()
        self.client.close()
        self._other.close()
