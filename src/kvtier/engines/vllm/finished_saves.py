"""Finished requests' saves, from the blocks vLLM keeps for them until they are reported done
(``get_finished``): all at once on a thread of their own, or inline -- the daemon's calls on a
thread, the copies on the engine's thread, spread over steps."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

from kvtier.engines.vllm.plan import Transfer
from kvtier.server.lease_client import WriteLease

log = logging.getLogger(__name__)

FINISH_CHUNKS_PER_ROUND = 8
"""Chunks of a finished request reserved (and then copied) at once, inline."""
FINISH_BYTES_PER_STEP = 64 << 20
"""Bytes of finished requests' chunks copied inline at most once a step is done (a round
begun is finished): a long request's save is spread over steps, not one long pause."""


@dataclass
class _Finishing:
    """A finished request's save copied inline: chunks ``done...`` of ``save`` wait for the
    slots ``future`` reserves."""

    save: Transfer
    done: int
    future: Future


class FinishedSaves:
    """:class:`~.worker.WorkerSide`'s saves of finished requests (a mixin: its state is the
    worker half's, set up in ``WorkerSide.__init__``)."""

    def _bg_reserve(self, save: Transfer, done: int) -> Future:
        """Slots for the next round of a finished request's chunks (at most
        :data:`FINISH_CHUNKS_PER_ROUND`: a round is copied in one step)."""
        keys = save.keys[done : done + FINISH_CHUNKS_PER_ROUND]
        last = done + len(keys) == len(save.keys)
        return self._bg_calls.submit(lambda: self._bg_client.reserve(
            keys, first=save.first_chunk + done, request=save.req_id,
            tail_tokens=self._tail_tokens(save) if last else 0))

    def _advance_finishes(self) -> None:
        """Copy the finished requests' chunks whose slots came back (on the engine's thread,
        after a forward pass: vLLM calls ``get_finished`` every step, empty ones included, while
        it keeps blocks for us), at most :data:`FINISH_BYTES_PER_STEP` a call; commit them on
        the calls' thread and reserve the next round. A request is reported done (vLLM frees
        its blocks) once its last round is committed, or once none more can be saved (no room,
        or the daemon is away)."""
        if not self._saving:
            return
        assert self._copier is not None
        left: list[_Finishing] = []
        budget = FINISH_BYTES_PER_STEP
        for f in self._saving:
            if budget <= 0 or not f.future.done():
                left.append(f)
                continue
            lease = self._bg_result(f.future)
            if lease is None or not lease.views:
                self._mark_done(f.save.req_id)  # no room at all now, or the daemon is away
                continue
            try:
                budget -= self._copy_whole(f.save, f.done, lease, background=True)
                self._copier.sync_saves(background=True)
            except Exception:
                log.exception("kvtier: saving finished request %s failed", f.save.req_id)
                self._bg_calls.submit(lambda lease=lease: self._bg_client.abandon(lease))
                self._mark_done(f.save.req_id)
                continue
            done = f.done + len(lease.views)
            last = done >= len(f.save.keys)
            rid = f.save.req_id
            commit = self._bg_calls.submit(lambda lease=lease: self._bg_client.commit(lease))
            if last:  # reported once committed: the next turn's lookup finds all of it
                commit.add_done_callback(lambda _f, rid=rid: self._mark_done(rid))
            else:
                left.append(_Finishing(f.save, done, self._bg_reserve(f.save, done)))
        self._saving = left

    @staticmethod
    def _bg_result(future: Future) -> WriteLease | None:
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled():
                log.warning("kvtier: reserving a finished request's chunks failed: %s", future.exception())
            return None
        return future.result()

    def _finish(self, save: Transfer) -> None:
        """A finished request's chunks, all layers at once, from blocks vLLM keeps for us."""
        try:
            self._save_rest(self._bg_client, save, 0)
        except Exception:
            log.exception("kvtier: saving finished request %s failed", save.req_id)
        finally:
            self._mark_done(save.req_id)

    def _mark_done(self, req_id: str) -> None:
        with self._done_lock:
            self._done.add(req_id)
