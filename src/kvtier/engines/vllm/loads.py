"""The worker half's loads: chunks copied from the daemon's arena into vLLM's blocks under a
read lease -- in the step (``start_load_kv``), layer by layer on a thread beside the forward
pass (``wait_for_layer_load``) or all at once on the engine's thread, or between steps (vLLM's
async loading). Blocks that did not arrive are reported to vLLM as load errors (it recomputes
them), and are suspect."""

from __future__ import annotations

import logging
import threading
import time

import torch

from kvtier.engines.vllm.calls import _LATE
from kvtier.engines.vllm.plan import Transfer
from kvtier.server.lease_client import ReadLease

log = logging.getLogger(__name__)


class Loads:
    """:class:`~.worker.WorkerSide`'s loads (a mixin: its state is the worker half's, set up
    in ``WorkerSide.__init__``)."""

    def start_load_kv(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        loads = [t for t in self._meta.loads if not t.background]
        for t in self._meta.loads:
            if t.background:  # after what the compute stream was given so far (a freed block)
                after = self._copier.mark() if self._copier is not None else None
                self._receiving.submit(self._load_between_steps, t, after)
        if not loads:
            self._send_reserves()
            return
        if not self.enabled:
            for load in loads:
                self._fail(load.lacking_ids(range(len(load.keys)), self.per_chunk))
            self._send_reserves()
            return
        plan: list[tuple[Transfer, list[torch.Tensor]]] = []
        t0 = time.monotonic()
        self._load_wait_s = 0.0
        for load, lease in zip(loads, self._acquire_all(loads), strict=True):
            views = lease.views if lease is not None else []
            if lease is not None:
                self._leases.append((load, lease))
            plan.append((load, views))
            missing = load.lacking_ids(range(len(views), len(load.keys)), self.per_chunk)
            if missing:  # chunks the daemon could not give (lost, or the daemon died): recomputed
                self._fail(missing)
        self._send_reserves()  # behind the acquires, ahead of the copies and the forward pass
        assert self._copier is not None
        self._copier.start()
        if self.inline:  # every layer now, before the forward pass (see ``inline``)
            self._copy_in(plan)
            self._load_wait_s += time.monotonic() - t0
            return
        self._load_wait_s += time.monotonic() - t0
        self._load_thread = threading.Thread(target=self._copy_in, args=(plan,), daemon=True,
                                             name="kvtier-vllm-load")
        self._load_thread.start()

    def _copy_in(self, plan: list[tuple[Transfer, list[torch.Tensor]]]) -> None:
        assert self._copier is not None
        a = self.adapter
        copier = self._copier
        try:
            ids = {(n, j): copier.load_ids([load.block_ids[i] for i in load.lacking(j, self.per_chunk)])
                   for n, (load, views) in enumerate(plan) for j in range(len(views))
                   if load.lacking(j, self.per_chunk)}  # once a step, not once a layer
            for layer, kv in enumerate(self.kv):
                for n, (load, views) in enumerate(plan):
                    for j, view in enumerate(views):
                        idx = load.lacking(j, self.per_chunk)
                        if not idx:
                            continue
                        pages = self._lacking_pages(view, layer, kv, load, j, idx)
                        copier.load(lambda k=kv, d=ids[(n, j)], p=pages: a.scatter(k, d, copier.up(p)))
                copier.layer_done(layer)
        except Exception:
            self._copy_failed = True  # every block of this step's loads is reported failed
            log.exception("kvtier: copying cached KV into vLLM's blocks failed")
        finally:
            self._copier.all_done()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load_thread is None or self._copier is None:
            return
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            t0 = time.monotonic()
            self._copier.wait_layer(layer)
            self._load_wait_s += time.monotonic() - t0

    def _finish_loads(self) -> None:
        """Join the copies, end the step's read leases; blocks copied under a lease the daemon
        could not confirm intact (or by a copy that failed) become load errors. Idempotent."""
        if self._load_thread is not None:
            t0 = time.monotonic()
            self._load_thread.join()
            self._load_thread = None
            assert self._copier is not None
            self._copier.sync()
            self._load_wait_s += time.monotonic() - t0
        c = self.layout.chunk_tokens
        releases = []
        for load, lease in self._leases:  # sent together, then waited for together
            took = self._took(load, len(lease.views))
            had = sum(c - t for t in took) if not load.tail_blocks else 0
            failed = len(lease.views) if self._copy_failed else 0
            releases.append(self._calls.submit(
                lambda lease=lease, took=took, had=had, failed=failed,
                waited=self._load_wait_s if self.log_loads else None:
                self.client.release(lease, took=took, had=had, failed=failed, wait_s=waited)))
        for (load, lease), future in zip(self._leases, releases, strict=True):
            # confirmed intact within what is left of the step's budget, else unsure: a miss
            intact = self._calls.wait(future, self.load_wait_s, False) is True
            blocks = load.lacking_ids(range(len(lease.views)), self.per_chunk)
            if not intact or self._copy_failed:
                self._fail(blocks)
            else:
                self._suspect.difference_update(blocks)  # freshly loaded: sound again
        self._leases = []

    def _took(self, load: Transfer, chunks: int) -> list[int]:
        """Tokens vLLM takes of each of the first ``chunks`` chunks of ``load``."""
        return [len(load.lacking(j, self.per_chunk)) * self.block_size for j in range(chunks)]

    def _lacking_pages(self, view: torch.Tensor, layer: int, kv: torch.Tensor, load: Transfer, j: int,
                       idx: list[int]) -> torch.Tensor:
        """The pages of blocks ``idx`` (``load.lacking(j)``, consecutive) in ``layer`` of
        ``keys[j]``'s slot ``view``."""
        first = (load.first_chunk + j) * self.per_chunk
        pages = len(load.blocks(j, self.per_chunk))
        return self._layer_pages(view, layer, kv, pages)[idx[0] - first : idx[-1] - first + 1]

    def _fail(self, blocks: list[int]) -> None:
        with self._done_lock:
            self._failed.update(blocks)
        self._suspect.update(blocks)

    def _load_between_steps(self, load: Transfer, after: torch.cuda.Event | None = None) -> None:
        """vLLM's async loading: the request waits, out of the batch, until ``get_finished``
        reports it; blocks that did not arrive are reported as load errors first."""
        wanted = load.lacking_ids(range(len(load.keys)), self.per_chunk)
        good: list[int] = []
        t0 = time.monotonic()  # (the request waits, out of the batch, this long)
        try:
            lease = self._bg_client.acquire(load.keys, first=load.first_chunk, request=load.req_id,
                                            tail_tokens=self._tail_tokens(load)) \
                if load.keys and self.enabled else None
            if lease is not None:
                assert self._copier is not None
                copied = False
                try:
                    for j, view in enumerate(lease.views):
                        idx = load.lacking(j, self.per_chunk)
                        if idx:
                            ids = self._copier.bg_ids([load.block_ids[i] for i in idx])
                            for layer, kv in enumerate(self.kv):
                                pages = self._lacking_pages(view, layer, kv, load, j, idx)
                                self._copier.load_now(kv, self.adapter, ids, pages, after)
                        good += [load.block_ids[i] for i in idx]
                    copied = True
                finally:
                    # every copy queued lands before the pins end, whatever failed (a device
                    # copy still reading a slot the daemon reuses would land torn bytes in a
                    # block vLLM computes again)
                    try:
                        self._copier.sync_now()
                    except Exception:
                        copied = False
                        log.exception("kvtier: waiting for request %s's copies failed", load.req_id)
                    took = self._took(load, len(lease.views))
                    intact = self._bg_client.release(lease, took=took, failed=0 if copied else len(lease.views),
                                                     wait_s=time.monotonic() - t0 if self.log_loads else None)
                    if not (intact and copied):
                        good = []
        except Exception:
            log.exception("kvtier: loading request %s between steps failed", load.req_id)
            good = []
        finally:
            bad = [blk for blk in wanted if blk not in set(good)]
            with self._done_lock:
                self._failed.update(bad)  # reported no later than the request itself
                self._landed.append((good, bad))
                self._received.add(load.req_id)

    def _acquire_all(self, loads: list[Transfer]) -> list[ReadLease | None]:
        """A read lease for each of ``loads``: the acquires sent together, then waited for
        within half of what is left of the step's budget; None where none came in time (its blocks
        fail; a lease that comes later is released at once). While the daemon is stalled,
        none is sent."""
        if self._calls.stalled(self.load_wait_s):
            return [None] * len(loads)
        futures = [self._calls.submit(
            lambda load=load: self.client.acquire(load.keys, first=load.first_chunk, request=load.req_id,
                                                  tail_tokens=self._tail_tokens(load)))
            if load.keys else None for load in loads]
        out: list[ReadLease | None] = []
        # at most half of what is left of the step's budget: the other half is the releases'
        # (a lease acquired, copied, then not confirmed in time is thrown away)
        until = time.monotonic() + min(self.load_wait_s, self._calls.left) / 2
        for future in futures:
            got = _LATE if future is None else self._calls.wait(
                future, max(0.0, until - time.monotonic()), _LATE, late=self._end_late_read)
            out.append(None if got is _LATE else got)  # type: ignore[arg-type]
        return out

    def _end_late_read(self, lease: ReadLease | None) -> None:
        if lease is not None:  # nothing was copied through it
            self.client.release(lease, took=[0] * len(lease.keys))
