"""The connector's worker half (next to the model, one per tensor-parallel rank): copies chunks
between the daemon's shared arena and vLLM's KV blocks.

Per step, in vLLM's order: ``bind`` (the step's plan; the reserves of its saves -- write
leases -- go out now, so the forward pass covers their round trip), ``start_load_kv`` (pin the
chunks to load -- a read lease -- and copy them: layer by layer on a background thread beside
an accelerator's compute, all at once on the engine's thread when vLLM's KV is in host memory),
the forward pass (``wait_for_layer_load`` before each layer's attention, ``save_kv_layer``
after it: at the first layer take the reserves already back and copy each layer's finished
pages in from then on), then ``wait_for_save`` (end the read leases; copy the saves whose
reserve came later, every layer at once from vLLM's blocks; decide what may be committed,
commit it; start the saves of finished requests) and ``get_finished`` (the finished requests
whose save is done: vLLM frees their blocks).

The engine loop never waits on the daemon for long (:mod:`.calls`), and a decode step not at
all as a rule: the step's daemon calls run on a thread of their own; the step waits for a
load's acquire and release at most ``load_wait_s`` (a load not confirmed by then is a load
error: vLLM recomputes those blocks), and for a save's reserve at most ``wait_s`` -- at the
first layer only in a step that prefills, and after the forward pass only when the pass was
shorter than the round trip (a save skipped so is reported to the scheduler, which plans it
again); commits are not waited for at all. A lease that comes back after the step gave up on
it is ended at once on that thread. :class:`~.calls.Calls` counts the times
the loop did block (the profile's ``loop_waits``). In all, a step that prefills may wait
``wait_s`` for its reserves at the first layer and ``wait_s`` more after the pass (and per
round of a save that found DRAM short), a decode step only after its pass.

What may be saved: a block is *suspect* when its load failed, or when it was computed over a
suspect block (vLLM's prefix cache shares blocks between requests, and a step scheduled before
a failure was known computes over it too), until a step computes it again from its first token.
A save whose blocks include a suspect one is never committed, on any rank: in an engine of
several ranks (tensor- and pipeline-parallel) every rank votes on every save, and each commits
only once all have said yes (:mod:`.votes`), since each rank's KV depends on every other's.

The step's daemon waits -- acquires, releases, reserves -- share one budget, ``load_wait_s``
(:meth:`~.calls.Calls.begin_step`): however many loads and saves a step holds, the loop waits on
the daemon at most that long in it, and what is not back by then is a miss.

Its loads are :mod:`.loads`, the step's saves :mod:`.saves`, and finished requests' saves
:mod:`.finished_saves`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.core.layout import KVLayout
from kvtier.engines.vllm.calls import Calls
from kvtier.engines.vllm.copies import Copier
from kvtier.engines.vllm.finished_saves import FinishedSaves, _Finishing
from kvtier.engines.vllm.loads import Loads
from kvtier.engines.vllm.pages import PageAdapter
from kvtier.engines.vllm.plan import KVTierMetadata, KVTierWorkerMeta, Transfer
from kvtier.engines.vllm.saves import Saves
from kvtier.engines.vllm.sleep import Sleep
from kvtier.engines.vllm.suspects import Suspects
from kvtier.engines.vllm.votes import Votes
from kvtier.server.client import StoreClient
from kvtier.server.lease_client import ReadLease, WriteLease

log = logging.getLogger(__name__)


class WorkerSide(Loads, Saves, FinishedSaves, Suspects, Votes, Sleep):
    def __init__(self, client: StoreClient, background: StoreClient, layout: KVLayout, block_size: int,
                 adapter: PageAdapter | None, ranks: int = 1, wait_s: float = 0.02,
                 load_wait_s: float = 1.0, inline: bool | None = None, log_loads: bool = True) -> None:
        self.client = client
        self.log_loads = log_loads  # (one rank's loads and waits go to the daemon's request log)
        self.wait_s = wait_s
        self.load_wait_s = load_wait_s
        self._calls = Calls("kvtier-step")
        self._unsaved: dict[str, int] = {}
        """Saves of this step skipped because the daemon did not answer in time (request ->
        first chunk), for the scheduler (:meth:`take_meta`)."""
        self.saves_skipped = 0
        """Saves skipped because the daemon was slow (each planned again)."""
        self.chunks_busy = 0
        """Chunks another writer was writing when a save asked for them (each planned again)."""
        self.load_error_blocks = 0
        """Blocks this rank reported to vLLM as failed loads."""
        self._bg_client = background
        self.layout = layout
        self.block_size = block_size
        self.per_chunk = layout.chunk_tokens // block_size
        self.adapter = adapter
        if ranks < 1:
            raise ValueError(f"an engine has at least one rank, got {ranks}")
        self.ranks = ranks
        """The engine's ranks (tensor x pipeline parallel): more than one, each save is voted on
        (:mod:`.votes`)."""
        self._ballots: dict[int, bool] = {}
        """This rank's votes not yet reported (ballot -> commit?)."""
        self._held: dict[int, tuple[float, WriteLease]] = {}
        """Saves copied and held for a verdict: ballot -> (since when, lease)."""
        self._held_finishes: dict[int, tuple[float, Transfer]] = {}
        """Finished requests whose save waits for a verdict: ballot -> (since when, save)."""
        self.kv: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self.enabled = False
        self._copier: Copier | None = None
        self._suspect: set[int] = set()
        self._failed: set[int] = set()
        """Blocks to report to vLLM as load errors (reported once, then cleared)."""
        self._page_bytes = 0
        self._meta = KVTierMetadata()
        self._loaded = False
        self._load_thread: threading.Thread | None = None
        self._load_wait_s = 0.0  # this step's wait for its loads (the daemon logs it per request)
        self._copy_failed = False
        self._leases: list[tuple[Transfer, ReadLease]] = []
        self._saves: list[WriteLease | None] | None = None
        """The write leases of this step's saves copied layer by layer, one per planned save
        (None: not copied so), taken at the step's first layer."""
        self._save_ids: dict[tuple[int, int], torch.Tensor] = {}
        self._reserving: list[Future | None] = []
        self._reserves_sent = True
        self._bound_at = time.monotonic()
        """The reserves of this step's saves, sent at ``bind`` (None: not sent): in flight
        while the forward pass runs, so no step waits a round trip for them."""
        self._deferred: dict[int, Future] = {}
        """Saves whose reserve was not back at the first layer: copied from vLLM's blocks,
        every layer at once, once the forward pass is done (``wait_for_save``)."""
        self._layers_saved: set[int] = set()
        self._save_failed = False
        """A layer's copy into this step's write leases raised: none of them is committed."""
        self._ended = True
        self.inline = inline
        """Copy the step's loads and finished requests' saves on the engine's thread, between
        its own work, not on threads beside it -- when vLLM's KV is in host memory (there a copy
        thread takes a core from the forward pass's threads, which all wait for the slowest;
        on an accelerator the copies run on streams and overlap the compute). None: so when
        the KV is in host memory; False: never. Loads between steps (``load_async``) keep a
        thread of their own either way."""
        self._finishing = ThreadPoolExecutor(1, "kvtier-finish")
        self._bg_calls = Calls("kvtier-finish-calls")
        self._saving: list[_Finishing] = []
        """Finished requests' saves copied inline (:meth:`_advance_finishes`)."""
        self._bg_failed_at = float("-inf")
        """When a finished request's save on the thread last met a daemon that failed."""
        self._retry: dict[str, set[int]] = {}
        """Finished requests' chunks another writer was writing, to ask for again."""
        self._receiving = ThreadPoolExecutor(1, "kvtier-receive")
        self._done_lock = threading.Lock()
        """Guards what the background threads hand over: the sets below and ``_failed``."""
        self._done: set[str] = set()
        self._received: set[str] = set()
        self._landed: list[tuple[list[int], list[int]]] = []
        """Background loads done: (blocks that arrived, blocks that did not), for the suspects."""

    # -- setup ---------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, problem: str | None = None) -> None:
        """vLLM's KV tensors; kvtier stays disabled in this worker (every load a miss, nothing
        saved) if they are not in the layout the namespace names, or ``problem`` says why not."""
        self.kv = list(kv_caches.values())
        self._layer_of = {name: i for i, name in enumerate(kv_caches)}
        try:
            if problem is not None:
                raise ValueError(problem)
            if self.adapter is None:
                raise ValueError("no page adapter for this attention backend")
            # a block a row, where vLLM split blocks into kernel blocks (a view: nothing copied)
            self.kv = [self.adapter.by_block(kv, num_blocks, self.block_size) for kv in self.kv]
            if len(self.kv) != self.layout.num_layers:
                raise ValueError(f"vLLM has {len(self.kv)} KV layers, the layout {self.layout.num_layers}")
            for kv in self.kv:
                self.adapter.check(kv, num_blocks, self.block_size, self.layout)
            if self.adapter.page_bytes(self.kv[0]) * self.per_chunk != self.layout.layer_bytes:
                raise ValueError(f"a page of {self.adapter.page_bytes(self.kv[0])} bytes does not fit "
                                 f"{self.per_chunk} pages per chunk layer of {self.layout.layer_bytes} bytes")
            self._page_bytes = self.adapter.page_bytes(self.kv[0])
        except ValueError as exc:
            log.error("kvtier disabled in this worker: %s", exc)
            return
        self._copier = Copier(self.kv[0].device, len(self.kv))
        # (an accelerator's copies are ordered by streams and events the inline path skips)
        self.inline = self.kv[0].device.type == "cpu" and self.inline is not False
        if self.kv[0].device.type == "cuda":  # page-locked arena: device copies at full speed
            self.client.pin_arena = True
            self._bg_client.pin_arena = True
        self.enabled = True

    # -- a step --------------------------------------------------------------------------------
    def bind(self, meta: KVTierMetadata) -> None:
        """A new step's plan. If the step before never reached ``wait_for_save``, it ends here:
        as a failed step if not every layer of its forward pass ran."""
        if not self._ended:  # (pipeline-parallel ranks with speculative decoding never call it)
            failed = self._incomplete()
            if failed:
                log.warning("kvtier: a step ended without wait_for_save; its loads and saves are dropped")
            self._end_step(failed=failed)
        with self._done_lock:
            landed, self._landed = self._landed, []
        for good, bad in landed:
            self._suspect.difference_update(good)
            self._suspect.update(bad)
        self._calls.begin_step(self.load_wait_s)  # every daemon wait of this step, in all
        if meta.verdicts or self._held or self._held_finishes:
            self._apply_verdicts(meta.verdicts)
        self._meta = meta
        self._loaded = False
        self._copy_failed = False
        self._save_failed = False
        self._layers_saved = set()
        self._ended = False
        self._bound_at = time.monotonic()
        self._reserving = []
        self._reserves_sent = False
        if not any(t.keys and not t.background for t in meta.loads):
            self._send_reserves()  # (a step that loads sends them after its acquires)

    def _send_reserves(self) -> None:
        """Send the reserves of the step's saves, once: at ``bind``, or right after the step's
        acquires when it loads (on the same calls' thread, in order: a reserve must not delay
        an acquire the step waits for, nor take the DRAM slots its promotions need)."""
        if self._reserves_sent:
            return
        self._reserves_sent = True
        self._reserving = [self._send_reserve(save) for save in self._meta.saves] if self.enabled else []

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        self._layers_saved.add(layer)  # distinct layers: every one of this rank ran, the pass is whole
        if not self._meta.saves or not self.enabled or self._save_failed:
            return
        try:
            self._save_layer(layer, kv_layer)
        except Exception:  # a copy must never take the forward pass down: nothing is committed
            self._save_failed = True
            log.exception("kvtier: copying layer %s into the arena failed; this step saves nothing", layer_name)

    def _save_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        assert self._copier is not None
        if self._saves is None:  # the step's first layer: take the slots reserved so far
            self._send_reserves()  # (if vLLM did not call start_load_kv before the pass)
            self._spread()  # as known now; wait_for_save decides with what the step's loads report
            self._saves = self._take_reserves()
            self._save_ids = {(n, j): self._copier.ids([save.block_ids[i] for i in save.blocks(j, self.per_chunk)])
                              for n, (save, lease) in enumerate(zip(self._meta.saves, self._saves, strict=True))
                              if lease is not None for j, view in enumerate(lease.views) if view is not None}
        for n, (save, lease) in enumerate(zip(self._meta.saves, self._saves, strict=True)):
            if lease is None:
                continue
            for j, view in enumerate(lease.views):
                if view is None:
                    continue
                ids = self._save_ids[(n, j)]
                dst = self._layer_pages(view, layer, kv_layer, len(save.blocks(j, self.per_chunk)))
                self._copier.save_pages(dst, kv_layer, self.adapter, ids)

    def _tail_tokens(self, t: Transfer) -> int:
        """Tokens of the transfer's last chunk when it is a partial one (0: all full)."""
        return t.tail_blocks * self.block_size

    def _layer_pages(self, view: torch.Tensor, layer: int, kv: torch.Tensor, pages: int) -> torch.Tensor:
        """The ``pages`` pages of ``layer`` in the slot ``view`` of a chunk of that many pages a
        layer (``per_chunk``, or a partial chunk's own: it is stored at its own size), in
        ``kv``'s shape."""
        n = pages * self._page_bytes
        return self.adapter.pages(view[layer * n : (layer + 1) * n], kv, pages)

    def wait_for_save(self) -> None:
        """End the step: commit what it saved, if every layer of it was copied and none of it is
        suspect (vLLM calls this even when the forward pass raised: then nothing is committed,
        and what the step computed is suspect)."""
        self._end_step(failed=self._incomplete())

    def _incomplete(self) -> bool:
        """Whether the step computed something (it has writes) but not every layer of it ran."""
        return bool(self._meta.writes) and len(self._layers_saved) < len(self.kv)

    def _end_step(self, failed: bool) -> None:
        meta = self._meta
        if not (failed or meta.loads or meta.saves or meta.finishes or self._suspect or self._leases
                or self._deferred or self._reserving or self._load_thread is not None):
            # the usual decode step: nothing loaded, saved or suspect -- no work, no daemon call
            self._ended = self._loaded = True
            self._saves = None
            self._advance_finishes()
            return
        self._ended = True
        if failed:
            self._copy_failed = True  # loads of a failed step are not trusted either
        self.start_load_kv()  # (vLLM calls it after the forward pass when a step loads nothing)
        self._finish_loads()
        self._spread()
        if failed:  # (after the spread: what a failed step wrote is never sound)
            for w in self._meta.writes:
                self._suspect.update(w.block_ids[w.start // self.block_size :])
        if self._saves is None:  # no layer took the reserves: every one is taken now
            self._saves = [None] * len(meta.saves)
            self._deferred = {n: f for n, f in enumerate(self._reserving) if f is not None}
        leases = self._saves
        # a reserve still out after the pass is waited for (its reply is most likely on the way:
        # the engine's threads had the cores), unless a call has been running since before the
        # step began (the daemon is stalled)
        stalled = self._calls.stalled(time.monotonic() - self._bound_at + self.wait_s)
        unsaved = failed or self._save_failed  # (a failed copy: what the step computed is sound)
        budget = 0.0 if unsaved or stalled else self.wait_s
        for n, future in sorted(self._deferred.items()):
            began = time.monotonic()
            leases[n] = self._copy_deferred(meta.saves[n], future, unsaved, budget)
            budget = max(0.0, budget - (time.monotonic() - began))
        self._saves, self._save_ids, self._reserving, self._deferred = None, {}, [], {}
        # one flag per planned save and finish, in the plan's order
        ok = [lease is not None and not unsaved and not self._is_suspect(save)
              for save, lease in zip(meta.saves, leases, strict=True)]
        ok += [self.enabled and not failed and not self._is_suspect(f) for f in meta.finishes]
        if self._copier is not None and any(lease is not None for lease in leases):
            try:
                self._copier.sync_saves()
            except Exception:  # the copies may not have landed: nothing is committed
                log.exception("kvtier: waiting for this step's copies into the arena failed")
                ok[: len(meta.saves)] = [False] * len(meta.saves)
        if self.ranks > 1:
            self._vote(meta, leases, ok)  # every rank says yes, or none commits
        else:
            self._commit(meta, leases, ok)
        self._advance_finishes()

    def _commit(self, meta: KVTierMetadata, leases: list[WriteLease | None], ok: list[bool]) -> None:
        """The end of a step of a single-rank engine: commit its saves (not waited for),
        abandon what may not be; start its finished requests' saves."""
        for save, lease, good in zip(meta.saves, leases, ok, strict=False):
            if lease is None:
                continue
            if not good:
                self._calls.submit(lambda lease=lease: self.client.abandon(lease))
                continue
            self._calls.submit(lambda lease=lease: self.client.commit(lease))  # not waited for
            self._report_busy(save, lease, 0)
            if len(lease.views) < len(save.keys):
                self._save_rest(self.client, save, len(lease.views), in_step=True)
        for f, good in zip(meta.finishes, ok[len(meta.saves) :], strict=True):
            if good:
                self._start_finish(f)
            else:
                self._mark_done(f.req_id)  # vLLM frees its blocks: nothing of it is saved

    def _start_finish(self, f: Transfer) -> None:
        """Save a finished request's chunks: inline, spread over steps, or on a thread (none:
        dropped by a cache reset, reported done at once)."""
        if not f.keys:
            self._mark_done(f.req_id)
        elif self.inline:
            self._saving.append(_Finishing(f, 0, self._bg_reserve(f, 0)))
        else:
            self._finishing.submit(self._finish, f)

    def take_meta(self) -> KVTierWorkerMeta | None:
        """What to tell the scheduler after this step (saves it must plan again, this rank's
        votes), once."""
        votes = self._take_votes() if self._ballots else {}
        if not (self._unsaved or votes):
            return None
        meta, self._unsaved = KVTierWorkerMeta(self._unsaved, votes), {}
        return meta

    def counters(self) -> dict[str, float]:
        """Cumulative counts for vLLM's metrics (:mod:`.stats`)."""
        c = self._copier
        out = {"saves_skipped": self.saves_skipped, "load_error_blocks": self.load_error_blocks,
               "chunks_busy": self.chunks_busy}
        if c is not None:
            out.update(loaded_bytes=c.loaded_bytes + c.loaded_bg_bytes, saved_bytes=c.saved_bytes + c.saved_bg_bytes)
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()  # (vLLM may ask before wait_for_save, with speculative decoding)
        with self._done_lock:
            failed, self._failed = self._failed, set()
        self.load_error_blocks += len(failed)
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose save is done, requests whose load between steps is done)."""
        self._advance_finishes()
        with self._done_lock:
            done, self._done = self._done, set()
            received, self._received = self._received, set()
        return done or None, received or None

    def close(self) -> None:
        self._receiving.shutdown(wait=True)
        self._finishing.shutdown(wait=True)
        self._drop_saving()  # never copied: their slots go back
        for future in self._reserving:  # a step that never ended
            if future is not None:
                self._calls.when_done(future, self._abandon_late)
        for _, lease in self._held.values():  # no verdict came: never committed
            self._calls.submit(lambda lease=lease: self.client.abandon(lease))
        self._reserving, self._held, self._held_finishes = [], {}, {}
        self._bg_calls.close()
        self._calls.close()
