"""The worker half's saves of a step's chunks: the reserves (write leases) sent at ``bind``,
taken at the step's first layer or, when they came back later, copied every layer at once from
vLLM's blocks after the forward pass; chunks that found no slot saved in rounds. A save the
daemon did not answer in time is skipped and reported to the scheduler, which plans it again."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from kvtier.engines.vllm.calls import _LATE
from kvtier.engines.vllm.plan import Transfer
from kvtier.server.client import StoreClient
from kvtier.server.lease_client import WriteLease

log = logging.getLogger(__name__)


class Saves:
    """:class:`~.worker.WorkerSide`'s saves (a mixin: its state is the worker half's, set up
    in ``WorkerSide.__init__``)."""

    def _save_rest(self, client: StoreClient, save: Transfer, done: int, in_step: bool = False) -> None:
        """Save chunks ``done...`` of ``save`` in rounds, all layers at once (chunks that found no
        DRAM slot at the first layer, or a finished request's): while one round's chunks are
        committed and demoted, the next round finds room. ``in_step``: inside vLLM's step, with
        the step's bounded waits (else on a background thread, with plain calls)."""
        assert self._copier is not None
        while done < len(save.keys):
            lease = self._reserve(save, done) if in_step else client.reserve(
                save.keys[done:], first=save.first_chunk + done, request=save.req_id,
                tail_tokens=self._tail_tokens(save))
            if lease is None or not lease.views:
                return  # no room at all now (everything pinned), or the daemon is away
            try:
                self._copy_whole(save, done, lease, background=True)
                self._copier.sync_saves(background=True)
            except BaseException:  # the lease ends here whatever happened (its slots go back)
                if in_step:
                    self._calls.submit(lambda lease=lease: client.abandon(lease))
                else:
                    client.abandon(lease)
                raise
            if in_step:
                self._calls.submit(lambda lease=lease: client.commit(lease))
                self._report_busy(save, lease, done)
            else:
                client.commit(lease)
                self._busy_chunks(save, lease, done)
            done += len(lease.views)

    def _send_reserve(self, save: Transfer) -> Future | None:
        """Send the reserve of a planned save now (``bind``); None, the save reported skipped,
        while the daemon is stalled."""
        if self._calls.stalled(self.wait_s):
            self._skipped(save, 0)
            return None
        return self._calls.submit(lambda: self.client.reserve(
            save.keys, first=save.first_chunk, request=save.req_id, tail_tokens=self._tail_tokens(save)))

    def _decode_only(self) -> bool:
        """Whether every request this step computes one token (a decode step): its forward
        pass is short, and a save's reserve is never waited for in it."""
        return bool(self._meta.writes) and all(w.end - w.start <= 1 for w in self._meta.writes)

    def _take_reserves(self) -> list[WriteLease | None]:
        """At the first layer: the leases back already (copied layer by layer from here on);
        a step that prefills waits for the others ``wait_s`` in all, a decode step not at all
        -- those not back are copied after the forward pass (:meth:`_copy_deferred`)."""
        budget = 0.0 if self._decode_only() else self.wait_s
        out: list[WriteLease | None] = []
        for n, (save, future) in enumerate(zip(self._meta.saves, self._reserving, strict=True)):
            if future is None:
                out.append(None)
            elif self._is_suspect(save):  # computed over blocks that never arrived
                self._calls.when_done(future, self._abandon_late)
                out.append(None)
            else:
                if budget > 0 and not future.done():
                    began = time.monotonic()
                    self._calls.wait(future, budget, None)  # (counted; the outcome is read below)
                    budget = max(0.0, budget - (time.monotonic() - began))
                if not future.done():
                    self._deferred[n] = future  # taken once the forward pass is done
                    out.append(None)
                elif future.cancelled() or future.exception() is not None:
                    self._skipped(save, 0)  # the reserve failed: planned again
                    out.append(None)
                else:
                    out.append(future.result())
        return out

    def _abandon_late(self, lease: WriteLease | None) -> None:
        if lease is not None:
            self.client.abandon(lease)

    def _copy_deferred(self, save: Transfer, future: Future, failed: bool, wait_s: float) -> WriteLease | None:
        """A save whose reserve was not back at the first layer: every layer copied now, from
        vLLM's blocks (the forward pass is done, they hold the chunk), once it is back -- it
        went out before the forward pass, which has most often covered its round trip; one
        still out is waited for at most ``wait_s`` (``_end_step``'s budget: none when the
        daemon is stalled), then reported skipped (planned again) and its lease abandoned
        when it comes."""
        got = self._calls.wait(future, wait_s, _LATE, late=self._abandon_late)
        if got is _LATE:
            self._skipped(save, 0)
            return None
        lease: WriteLease | None = got  # type: ignore[assignment]
        if lease is None:
            return None
        if failed or self._is_suspect(save) or self._copier is None:
            self._calls.submit(lambda: self.client.abandon(lease))
            return None
        try:
            self._copy_whole(save, 0, lease)
        except Exception:  # never committed: its slots go back
            log.exception("kvtier: copying request %s's chunks into the arena failed", save.req_id)
            self._calls.submit(lambda: self.client.abandon(lease))
            return None
        return lease

    def _copy_whole(self, save: Transfer, done: int, lease: WriteLease, background: bool = False) -> int:
        """Copy chunks ``done...`` of ``save`` into ``lease``'s slots, every layer at once, from
        vLLM's blocks (their KV is computed); the bytes copied."""
        assert self._copier is not None
        copied = 0
        for j, view in enumerate(lease.views):
            if view is None:
                continue
            blocks = [save.block_ids[i] for i in save.blocks(done + j, self.per_chunk)]
            ids = self._copier.ids(blocks)  # once a chunk, not once a layer
            for layer, kv in enumerate(self.kv):
                dst = self._layer_pages(view, layer, kv, len(blocks))
                self._copier.save_pages(dst, kv, self.adapter, ids, background=background)
                copied += dst.nbytes
        return copied

    def _skipped(self, save: Transfer, done: int) -> None:
        """A save (from chunk ``done`` on) skipped because the daemon did not answer in time:
        reported to the scheduler, which plans it again (:meth:`take_meta`)."""
        self._replan(save, done)
        self.saves_skipped += 1

    def _replan(self, save: Transfer, done: int) -> None:
        """Tell the scheduler to plan chunks ``done...`` of ``save`` again (its next step's
        plan reserves them again; those stored meanwhile come back held)."""
        first = save.first_chunk + done
        self._unsaved[save.req_id] = min(first, self._unsaved.get(save.req_id, first))

    def _busy(self, lease: WriteLease) -> list[int]:
        """Indices of ``lease``'s chunks another writer was writing (no slot, and not held),
        counted in ``chunks_busy``."""
        busy = [j for j, (view, held) in enumerate(zip(lease.views, lease.held, strict=True))
                if view is None and not held]
        if busy:
            with self._done_lock:  # (the engine's thread and the finishing thread count)
                self.chunks_busy += len(busy)
        return busy

    def _report_busy(self, save: Transfer, lease: WriteLease, done: int) -> None:
        """Chunks another writer was writing (``lease`` covers chunks ``done...`` of ``save``)
        are not stored by this save: the scheduler plans them again -- if the other writer
        commits, they are then held; if it abandons, this request writes them. BUSY is never
        taken for stored."""
        busy = self._busy(lease)
        if busy:
            self._replan(save, done + busy[0])

    def _busy_chunks(self, save: Transfer, lease: WriteLease, done: int) -> None:
        """A finished request's chunks another writer was writing: kept in ``save``'s list of
        chunks to ask for again once its other chunks are saved (:mod:`.finished_saves`)."""
        busy = self._busy(lease)
        if busy:
            self._retry.setdefault(save.req_id, set()).update(done + j for j in busy)

    def _reserve(self, save: Transfer, done: int) -> WriteLease | None:
        """Slots for chunks ``done...`` of ``save`` within ``wait_s``; None if there are none
        now. A reserve the daemon did not answer in time is reported (:meth:`take_meta`)."""
        got = self._calls.call(
            lambda: self.client.reserve(save.keys[done:], first=save.first_chunk + done, request=save.req_id,
                                        tail_tokens=self._tail_tokens(save)),
            self.wait_s, _LATE, late=self._abandon_late)
        if got is _LATE:
            self._skipped(save, done)
            return None
        return got  # type: ignore[return-value]
