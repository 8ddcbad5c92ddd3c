"""Finished requests' saves, from the blocks vLLM keeps for them until they are reported done
(``get_finished``): all at once on a thread of their own, or inline -- the daemon's calls on a
thread, the copies on the engine's thread, spread over steps."""

from __future__ import annotations

import logging
import time
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
BUSY_TRIES = 3
"""Times a finished request asks again for chunks another writer was writing (once its other
chunks are saved; inline, one try a step): if that writer abandons them, this save writes them.
Then vLLM gets the request's blocks back whatever the other writer does."""
BUSY_RETRY_S = 0.05
"""The pause before a finished request saved on a thread asks again."""
STALLED_S = 1.0
"""A daemon that has not answered a finished request's call for this long is taken as stalled:
the finished requests waiting behind it are let go unsaved (vLLM gets their blocks back now --
a pause or a reset waits for them -- not one client timeout after the other)."""
AWAY_S = 5.0
"""After a finished request's save on the finishing thread met a daemon that failed, the
finished requests queued behind it are let go unsaved for this long (one client timeout)."""


@dataclass
class _Finishing:
    """A finished request's save copied inline: chunks ``done...`` of ``save`` wait for the
    slots ``future`` reserves."""

    save: Transfer
    done: int
    future: Future
    tries: int = 0
    """Times this request asked again for chunks another writer was writing."""


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
        if self._bg_calls.stalled(STALLED_S):
            self._let_go()
            return
        left: list[_Finishing] = []
        budget = FINISH_BYTES_PER_STEP
        for f in self._saving:
            if budget <= 0 or not f.future.done():
                left.append(f)
                continue
            lease = self._bg_result(f.future)
            if lease is None or not lease.views:
                self._retry.pop(f.save.req_id, None)
                self._mark_done(f.save.req_id)  # no room at all now, or the daemon is away
                continue
            try:
                budget -= self._copy_whole(f.save, f.done, lease, background=True)
                self._copier.sync_saves(background=True)
            except Exception:
                log.exception("kvtier: saving finished request %s failed", f.save.req_id)
                self._bg_calls.submit(lambda lease=lease: self._bg_client.abandon(lease))
                self._retry.pop(f.save.req_id, None)
                self._mark_done(f.save.req_id)
                continue
            done = f.done + len(lease.views)
            rid = f.save.req_id
            commit = self._bg_calls.submit(lambda lease=lease: self._bg_client.commit(lease))
            self._busy_chunks(f.save, lease, f.done)
            if done < len(f.save.keys):
                left.append(_Finishing(f.save, done, self._bg_reserve(f.save, done), f.tries))
                continue
            again = self._busy_again(f.save, f.tries)
            if again is not None:  # asked for again, one try a step
                left.append(_Finishing(again, 0, self._bg_reserve(again, 0), f.tries + 1))
            else:  # reported once committed: the next turn's lookup finds all of it
                commit.add_done_callback(lambda _f, rid=rid: self._mark_done(rid))
        self._saving = left

    def _busy_again(self, save: Transfer, tries: int) -> Transfer | None:
        """The chunks of a finished request's save that another writer was writing, to ask for
        again (the run from the first to the last of them: those stored meanwhile come back
        held); None when there are none, or after :data:`BUSY_TRIES` tries."""
        busy = self._retry.pop(save.req_id, None)
        if not busy or tries >= BUSY_TRIES:
            return None
        lo, hi = min(busy), max(busy) + 1
        return Transfer(save.req_id, save.keys[lo:hi], save.first_chunk + lo, save.block_ids,
                        tail_blocks=save.tail_blocks if hi == len(save.keys) else 0)

    def _let_go(self) -> None:
        """The daemon is stalled: the finished requests copied inline are let go unsaved."""
        log.warning("kvtier: the daemon has not answered for %.0f s; %d finished requests are not saved",
                    STALLED_S, self._drop_saving())

    def _drop_saving(self) -> int:
        """Report every finished request copied inline done, unsaved (vLLM frees its blocks); a
        reserve not sent yet never is, a lease that comes (or came) is abandoned on the calls'
        thread. How many were dropped."""
        for f in self._saving:
            if not f.future.cancel():  # running, or done: whatever it got is ended
                self._bg_calls.when_done(f.future, self._abandon_bg_late)
            self._retry.pop(f.save.req_id, None)
            self._mark_done(f.save.req_id)
        dropped, self._saving = len(self._saving), []
        return dropped

    def _abandon_bg_late(self, lease: WriteLease | None) -> None:
        if lease is not None:
            self._bg_client.abandon(lease)

    @staticmethod
    def _bg_result(future: Future) -> WriteLease | None:
        if future.cancelled() or future.exception() is not None:
            if not future.cancelled():
                log.warning("kvtier: reserving a finished request's chunks failed: %s", future.exception())
            return None
        return future.result()

    def _finish(self, save: Transfer) -> None:
        """A finished request's chunks, all layers at once, from blocks vLLM keeps for us (on
        the finishing thread; not within :data:`AWAY_S` of one that met a daemon that failed:
        then let go unsaved, as :meth:`_let_go` does)."""
        if time.monotonic() - self._bg_failed_at < AWAY_S:
            self._mark_done(save.req_id)
            return
        errors = self._bg_client.errors
        try:
            self._save_rest(self._bg_client, save, 0)
            tries = 0
            while (again := self._busy_again(save, tries)) is not None:
                time.sleep(BUSY_RETRY_S)  # (the other writer's commit is most likely on its way)
                self._save_rest(self._bg_client, again, 0)
                save, tries = again, tries + 1
        except Exception:
            log.exception("kvtier: saving finished request %s failed", save.req_id)
        finally:
            self._retry.pop(save.req_id, None)
            self._mark_done(save.req_id)
            if self._bg_client.errors != errors:
                self._bg_failed_at = time.monotonic()

    def _mark_done(self, req_id: str) -> None:
        with self._done_lock:
            self._done.add(req_id)
