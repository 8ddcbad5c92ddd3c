"""kvtier as a vLLM V1 KV connector: to vLLM, a kvtier hit looks like a prefix-cache hit.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.engines.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/kvtier.sock"}}'

with a store daemon running (``kvtier store serve``; it needs no model). Both halves of the
connector -- the scheduler's, in vLLM's engine-core process, and the worker's, next to the model
-- are clients of that daemon, and name the same namespace in their hello: the model's
fingerprint (``kv_connector_extra_config.model_id`` overrides it), the KV layout vLLM's config
implies, with ``chunk_tokens`` (extra config, default 256, rounded up to a multiple of vLLM's
block size), and the page format (backend, dtype, block size).

Scheduler side: ``get_num_new_matched_tokens`` looks the prompt up (all but its last token);
``on_new_request`` tells the daemon the request is queued (policies with a look-ahead window hear
of it, and its chunks on SSD are promoted to DRAM while it waits), and ``get_num_new_matched_tokens``
that it is being scheduled; the metadata of each step tells the workers which chunks to load into which
blocks, and which newly computed prompt chunks to save from which blocks.

Worker side: ``start_load_kv`` pins the chunks in the daemon's shared arena (a read lease) and
starts copying them, layer by layer, into vLLM's blocks on a background thread;
``wait_for_layer_load`` waits for just that layer. ``wait_for_save`` releases the lease: if the
daemon cannot confirm it was intact the whole time (the connection broke or timed out, the
daemon restarted), every block copied under it is reported to vLLM as a load error, and vLLM
discards that step's output for the request and recomputes the blocks. ``save_kv_layer`` copies
each layer's finished pages into reserved slots (a write lease) as the forward pass produces
them, and ``wait_for_save`` commits them.

Pages are copied whole: vLLM's CPU backend keeps, per block and head, the block's K (transposed
on the fp32 path) then its V, so a block is an opaque page whose meaning depends on the backend;
the page format (backend, dtype, block size) is part of the namespace so pages of different
layouts never mix. A daemon that is down, dies or restarts costs hits, never a request: lookups then
miss, and blocks whose load fails are reported to vLLM to be recomputed.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.core.keys import ChunkKey
from kvtier.core.layout import KVLayout
from kvtier.engines.hf import model_fingerprint
from kvtier.errors import DaemonUnavailable
from kvtier.server.client import ReadLease, StoreClient, WriteLease

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 256


def page_format(dtype: str, block_size: int, device: str = "cpu", tp_rank: int = 0, tp_size: int = 1) -> str:
    """What a vLLM page is, as part of the namespace: pages of other formats, and other
    tensor-parallel shards, never match."""
    shard = f"-tp{tp_rank}of{tp_size}" if tp_size > 1 else ""
    return f"vllm-{device}-{dtype}-bs{block_size}{shard}"


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 in the scheduler, or before vLLM set it up)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialized (the scheduler's process)
        return 0


def vllm_layout(vllm_config, chunk_tokens: int) -> KVLayout:  # type: ignore[no-untyped-def]
    """The KV layout of the model vLLM serves, in chunks of ``chunk_tokens``."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return KVLayout(num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
                    head_dim=mc.get_head_size(), dtype=str(mc.dtype).removeprefix("torch."),
                    chunk_tokens=chunk_tokens)


@dataclass
class ChunkTransfer:
    """Chunks ``first_chunk ..`` of one request, and the request's block ids."""

    req_id: str
    keys: list[ChunkKey]
    first_chunk: int
    block_ids: list[int]
    skip_blocks: int = 0
    """Blocks vLLM already has (its own prefix cache): not to be overwritten."""


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)


@dataclass
class _Request:
    prompt: list[int]
    keys: list[ChunkKey]
    block_ids: list[int]
    saved: int
    """Chunks known to be stored (hit or already sent for saving)."""


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
        self.model_id = cfg.get_from_extra_config("model_id", None) or model_fingerprint(
            vllm_config.model_config.model)
        tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        # Each rank stores its own shard of every chunk under its own namespace; the scheduler
        # looks up rank 0's (a rank missing a chunk reports its blocks as load errors).
        rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self.page_format = page_format(self.layout.dtype, self.block_size, tp_rank=rank, tp_size=tp_size)
        retry_s = float(cfg.get_from_extra_config("retry_s", 1.0))
        instance = str(getattr(cfg, "engine_id", "") or "")  # shared by the scheduler and its workers

        def client() -> StoreClient:
            return StoreClient(str(socket_path) if socket_path else None, model=self.model_id,
                               layout=self.layout, page_format=self.page_format, retry_s=retry_s,
                               instance=instance or None)

        self.client = client()
        self._role = role
        # scheduler state
        self._lookups: dict[str, tuple[list[ChunkKey], int]] = {}
        self._requests: dict[str, _Request] = {}
        self._loads: list[ChunkTransfer] = []
        self._skip: set[str] = set()
        self._hints = ThreadPoolExecutor(1, "kvtier-hints")
        self._hint_client = client()
        # worker state
        self._kv: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self._load_events: list[threading.Event] = []
        self._load_thread: threading.Thread | None = None
        self._leases: list[tuple[ChunkTransfer, ReadLease]] = []
        self._copy_failed = False
        self._failed_blocks: set[int] = set()
        self._bad_reqs: set[str] = set()
        """Requests of this step whose load failed: what the step computes for them attended
        to blocks that never arrived, so none of it is saved."""
        self._poisoned: dict[str, int] = {}
        """Request -> first chunk whose KV in vLLM's blocks is not to be trusted, until a save of
        it starts at or before that chunk again (vLLM recomputed from there). Kept across
        steps: a step scheduled before the failure was known computed over it too."""
        self._pending_saves: list[tuple[ChunkTransfer, WriteLease | None]] = []

    # -- geometry -------------------------------------------------------------------------------
    def _chunk_tokens(self) -> int:
        return self.layout.chunk_tokens

    # ==================================================================== scheduler side
    @staticmethod
    def _skipped(request) -> bool:  # type: ignore[no-untyped-def]
        """A request may opt out: ``SamplingParams(extra_args={"kv_transfer_params":
        {"kvtier": "skip"}})`` -- no lookup, no save (a baseline run, a private prompt)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        return params.get("kvtier") == "skip"

    def on_new_request(self, request) -> None:  # type: ignore[no-untyped-def]
        if self._skipped(request):
            self._skip.add(request.request_id)
            return
        prompt = list(request.prompt_token_ids or [])

        rid = str(request.request_id)

        def hint() -> None:
            try:
                self._hint_client.queued(rid, self._hint_client.keys_for(prompt[:-1]))
            except DaemonUnavailable:
                pass
            except Exception:  # a hint must never take the scheduler down
                log.exception("kvtier: queued hint failed")

        # The daemon's policies hear of the waiting request (AttentionStore's look-ahead window)
        # and its chunks move SSD -> DRAM while it waits in the queue.
        self._hints.submit(hint)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:  # type: ignore[no-untyped-def]
        prompt = list(request.prompt_token_ids or [])
        if self._skipped(request) or len(prompt) < 2:
            return 0, False
        self.client.started(str(request.request_id))
        hit = self.client.lookup(prompt[:-1], request=str(request.request_id))  # one token must be left to compute
        self._lookups[request.request_id] = (hit.keys, num_computed_tokens)
        return max(0, hit.hit_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:  # type: ignore[no-untyped-def]
        keys, local = self._lookups.pop(request.request_id, ([], 0))
        if num_external_tokens <= 0:
            return
        c = self._chunk_tokens()
        total = local + num_external_tokens
        if total > len(keys) * c:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first = local // c
        self._loads.append(ChunkTransfer(
            req_id=request.request_id, keys=keys[first : total // c], first_chunk=first,
            block_ids=block_ids[: total // self.block_size], skip_blocks=local // self.block_size,
        ))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:  # type: ignore[no-untyped-def]
        so = scheduler_output
        meta = KVTierMetadata(loads=self._loads)
        self._loads = []
        c = self._chunk_tokens()
        for r in so.scheduled_new_reqs:
            if r.req_id in self._skip:
                continue
            prompt = list(r.prompt_token_ids or [])
            try:
                keys = self.client.keys_for(prompt)
            except DaemonUnavailable:
                continue
            hit_chunks = min(r.num_computed_tokens // c, len(keys))
            self._requests[r.req_id] = _Request(prompt, keys, list(r.block_ids[0]), hit_chunks)
            self._plan_saves(meta, r.req_id, r.num_computed_tokens + so.num_scheduled_tokens[r.req_id], c)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in getattr(cached, "resumed_req_ids", ()):
                # resumed after a preemption: its old blocks were freed; these are all its blocks
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            if cached.num_computed_tokens[i] < state.saved * c:
                # vLLM went back (blocks whose load failed are recomputed): those chunks were
                # not saved (a step over a failed load saves nothing), so save them once redone
                state.saved = cached.num_computed_tokens[i] // c
            self._plan_saves(meta, req_id, cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id], c)
        for req_id in so.finished_req_ids:
            self._requests.pop(req_id, None)
            self._skip.discard(req_id)
            self._hints.submit(self._hint_client.finished, str(req_id))
        return meta

    def _plan_saves(self, meta: KVTierMetadata, req_id: str, done_tokens: int, c: int) -> None:
        """Save the prompt chunks this step completes."""
        state = self._requests[req_id]
        full = min(done_tokens, len(state.prompt)) // c
        if full > state.saved and full * c // self.block_size <= len(state.block_ids):
            meta.saves.append(ChunkTransfer(
                req_id=req_id, keys=state.keys[state.saved : full], first_chunk=state.saved,
                block_ids=state.block_ids[: full * c // self.block_size],
            ))
            state.saved = full

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:  # type: ignore[no-untyped-def]
        self._requests.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._skip.discard(request.request_id)
        return False, None

    def update_connector_output(self, connector_output) -> None:  # type: ignore[no-untyped-def]
        return None

    def take_events(self):  # type: ignore[no-untyped-def]
        return ()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: vLLM never waits for it to deliver

    # ======================================================================= worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = list(kv_caches.values())
        self._layer_of = {name: i for i, name in enumerate(kv_caches)}
        # The block dimension: 0 on the CPU backend ([blocks, heads, block, 2*head_dim]), 1 on
        # CUDA flash-attention ([2, blocks, block, heads, head_dim]). Found by its size.
        shape = tuple(self._kv[0].shape)
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self._block_dim = shape.index(num_blocks) if num_blocks in shape else 0

    def _pages(self, chunk_bytes: torch.Tensor, layer: int) -> torch.Tensor:
        """One layer of one chunk as vLLM's tensor of that layer restricted to the chunk's
        blocks (in the chunk's order): same shape but ``blocks_per_chunk`` on the block dim."""
        layout = self.layout
        kv = self._kv[layer]
        lo = layout.layer_offset(layer)
        shape = list(kv.shape)
        shape[self._block_dim] = layout.chunk_tokens // self.block_size
        return chunk_bytes[lo : lo + layout.layer_bytes].view(kv.dtype).view(shape)

    def _check_geometry(self) -> bool:
        layout = self.layout
        kv = self._kv[0]
        page_bytes = kv.numel() // kv.shape[self._block_dim] * kv.element_size()
        ok = (len(self._kv) == layout.num_layers
              and page_bytes * (layout.chunk_tokens // self.block_size) == layout.layer_bytes)
        if not ok:
            log.error("kvtier layout %s does not match vLLM's KV cache %s x %d layers; disabled",
                      layout, tuple(self._kv[0].shape), len(self._kv))
        return ok

    def start_load_kv(self, forward_context, **kwargs) -> None:  # type: ignore[no-untyped-def]
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._failed_blocks = set()
        self._bad_reqs = set()
        self._copy_failed = False
        if not meta.loads or not self._check_geometry():
            for load in meta.loads:  # nothing can be loaded: let vLLM recompute these blocks
                self._fail(load, load.skip_blocks)
            self._taint_sharers(meta)
            return
        plan: list[tuple[ChunkTransfer, list[torch.Tensor]]] = []
        per_chunk = self.layout.chunk_tokens // self.block_size
        for load in meta.loads:
            lease = self.client.acquire(load.keys, first=load.first_chunk, request=load.req_id)
            views = lease.views if lease is not None else []
            if lease is not None:
                self._leases.append((load, lease))
            plan.append((load, views))
            # chunks the daemon could not give (lost, or the daemon died) are recomputed by vLLM
            loaded = (load.first_chunk + len(views)) * per_chunk
            if load.block_ids[max(loaded, load.skip_blocks) :]:
                self._fail(load, max(loaded, load.skip_blocks))
        self._taint_sharers(meta)
        self._load_events = [threading.Event() for _ in self._kv]
        self._load_thread = threading.Thread(target=self._copy_in, args=(plan,), daemon=True,
                                             name="kvtier-vllm-load")
        self._load_thread.start()

    def _fail(self, load: ChunkTransfer, first_block: int) -> None:
        """Blocks ``first_block...`` of ``load`` did not arrive: vLLM recomputes them, and what
        this request computes over them is never saved."""
        self._failed_blocks.update(load.block_ids[first_block:])
        self._bad_reqs.add(load.req_id)
        chunk = first_block // (self.layout.chunk_tokens // self.block_size)
        self._poisoned[load.req_id] = min(chunk, self._poisoned.get(load.req_id, chunk))

    def _taint_sharers(self, meta: KVTierMetadata) -> None:
        """A request whose blocks include a failed one (vLLM's prefix cache shares blocks between
        the requests of a step) computed over it too: nothing of it is saved either."""
        if not self._failed_blocks:
            return
        per_chunk = self.layout.chunk_tokens // self.block_size
        for save in meta.saves:
            bad = next((i for i, b in enumerate(save.block_ids) if b in self._failed_blocks), None)
            if bad is not None:
                self._bad_reqs.add(save.req_id)
                chunk = bad // per_chunk
                self._poisoned[save.req_id] = min(chunk, self._poisoned.get(save.req_id, chunk))

    def _saveable(self, save: ChunkTransfer) -> bool:
        """Whether what ``save`` would store was computed over KV that arrived."""
        if save.req_id in self._bad_reqs:
            return False
        poisoned = self._poisoned.get(save.req_id)
        if poisoned is None:
            return True
        if save.first_chunk <= poisoned:  # vLLM went back and computes from there again
            del self._poisoned[save.req_id]
            return True
        return False

    def _copy_in(self, plan: list[tuple[ChunkTransfer, list[torch.Tensor]]]) -> None:
        dim = self._block_dim
        per_chunk = self.layout.chunk_tokens // self.block_size
        try:
            with torch.inference_mode():
                for layer, kv in enumerate(self._kv):
                    for load, views in plan:
                        for j, view in enumerate(views):
                            base = (load.first_chunk + j) * per_chunk
                            keep = [p for p in range(per_chunk) if base + p >= load.skip_blocks]
                            pages = self._pages(view, layer)
                            if len(keep) < per_chunk:  # vLLM already has the first blocks
                                pages = pages.index_select(dim, torch.tensor(keep))
                            dst = torch.tensor([load.block_ids[base + p] for p in keep], device=kv.device)
                            kv.index_copy_(dim, dst, pages.to(kv.device))
                    if kv.is_cuda:  # the copies must land before the layer's attention runs
                        torch.cuda.synchronize(kv.device)
                    self._load_events[layer].set()
        except BaseException:
            self._copy_failed = True  # every block of this step's loads is reported failed
            log.exception("kvtier: copying cached KV into vLLM's blocks failed")
        finally:
            for event in self._load_events:
                event.set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._load_events:
            return
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self._load_events[layer].wait()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:  # type: ignore[no-untyped-def]
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        layer = self._layer_of.get(layer_name)
        if layer is None or not meta.saves:
            return
        if layer == 0:
            self._pending_saves = []
            if self._check_geometry():
                for save in meta.saves:
                    if not self._saveable(save):
                        continue  # computed over blocks that never arrived: never saved
                    lease = self.client.reserve(save.keys, first=save.first_chunk, request=save.req_id)
                    self._pending_saves.append((save, lease))
        per_chunk = self.layout.chunk_tokens // self.block_size
        with torch.inference_mode():
            for save, lease in self._pending_saves:
                if lease is None:
                    continue
                for j, view in enumerate(lease.views):
                    if view is None:
                        continue
                    base = (save.first_chunk + j) * per_chunk
                    idx = torch.tensor(save.block_ids[base : base + per_chunk], device=kv_layer.device)
                    self._pages(view, layer).copy_(kv_layer.index_select(self._block_dim, idx))

    def _end_loads(self) -> None:
        """Release this step's read leases; every block copied under a lease the daemon could
        not confirm intact (or by a copy that failed) goes to vLLM as a load error."""
        per_chunk = self.layout.chunk_tokens // self.block_size
        c = self.layout.chunk_tokens
        for load, lease in self._leases:
            first_block = load.first_chunk * per_chunk
            took = [c - max(0, min(per_chunk, load.skip_blocks - (first_block + j * per_chunk))) * self.block_size
                    for j in range(len(lease.views))]
            had = sum(c - t for t in took)
            intact = self.client.release(lease, took=took, had=had,
                                         failed=len(lease.views) if self._copy_failed else 0)
            if not intact or self._copy_failed:
                self._fail(load, max(first_block, load.skip_blocks))
        self._leases = []

    def wait_for_save(self) -> None:
        if self._load_thread is not None:
            self._load_thread.join()
            self._load_thread = None
            self._load_events = []
        self._end_loads()
        meta = self._get_connector_metadata()
        if isinstance(meta, KVTierMetadata):
            self._taint_sharers(meta)  # blocks of leases lost just now
        for save, lease in self._pending_saves:
            if save.req_id in self._bad_reqs:  # its load turned out lost: what it computed is not saved
                if lease is not None:
                    self.client.abandon(lease)
                continue
            done = 0
            if lease is not None:
                self.client.commit(lease)
                done = len(lease.views)
            if done < len(save.keys):
                self._save_rest(save, done)
        self._pending_saves = []

    def _save_rest(self, save: ChunkTransfer, done: int) -> None:
        """Chunks that found no DRAM slot at the first layer: now that the first ones are
        committed (and can be demoted), save the rest in rounds, all layers at once. vLLM's
        blocks still hold them until the step ends."""
        per_chunk = self.layout.chunk_tokens // self.block_size
        with torch.inference_mode():
            while done < len(save.keys):
                lease = self.client.reserve(save.keys[done:], first=save.first_chunk + done, request=save.req_id)
                if lease is None or not lease.views:
                    return  # no room at all now (everything pinned), or the daemon is away
                for j, view in enumerate(lease.views):
                    if view is None:
                        continue
                    base = (save.first_chunk + done + j) * per_chunk
                    idx = torch.tensor(save.block_ids[base : base + per_chunk], device=self._kv[0].device)
                    for layer, kv in enumerate(self._kv):
                        self._pages(view, layer).copy_(kv.index_select(self._block_dim, idx))
                self.client.commit(lease)
                done += len(lease.views)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:  # (the worker's side: called every step)
            self._poisoned.pop(req_id, None)
        return None, None

    def shutdown(self) -> None:
        self._hints.shutdown(wait=False)
        self.client.close()
        self._hint_client.close()
