"""The scheduler half's hints to the daemon's policies: a request queued, started, finished,
and the promotion into DRAM of the chunks of a request waiting at the queue's head. Hints go
out on a thread of their own and are dropped, counted, while :data:`MAX_HINTS` of them wait."""

from __future__ import annotations

import dataclasses
import logging
import time

from kvtier.core.keys import ChunkKey
from kvtier.core.session_hints import HintError, SessionHint
from kvtier.engines.vllm.lookups import MAX_PENDING_LOOKUPS, _Lookup
from kvtier.engines.vllm.request_state import request_hint, skipped
from kvtier.errors import DaemonUnavailable

log = logging.getLogger(__name__)

MAX_HINTS = 1024
"""Hints waiting to be sent at most; more are dropped (a stalled daemon must not grow a queue)."""


class Hints:
    """:class:`~.scheduler.SchedulerSide`'s hints (a mixin: its state is the scheduler half's,
    set up in ``SchedulerSide.__init__``)."""

    def on_new_request(self, request) -> None:  # type: ignore[no-untyped-def]
        """The daemon's policies hear of the waiting request (AttentionStore's look-ahead window)
        and its chunks move SSD -> DRAM while it waits in the queue."""
        if skipped(request):
            return
        rid, tokens = str(request.request_id), list(request.all_token_ids)[:-1]
        hint = request_hint(request)
        if isinstance(hint, HintError):  # (kvtier serve's API middleware refuses it first)
            self.hints_malformed += 1
            log.warning("kvtier: request %s served without its session hint: %s", rid, hint)
            hint = None
        self._hint_later(self._queued, request, rid, tokens, hint)
        # its lookup goes out now, for no local tokens (it serves any local hit vLLM then
        # finds: :func:`_serves`): by the step that first asks, the answer is most often back,
        # and no running request's step waits for it
        n = len(tokens)
        if n >= self.block_size and rid not in self._pending and rid not in self._lookups \
                and not self._calls.stalled(self.lookup_deadline_s) and self._calls.pending < MAX_PENDING_LOOKUPS:
            self._submit(rid, request, n, 0, time.monotonic())

    def _promote_waiting(self, rid: str, found: _Lookup) -> None:
        """A request vLLM asks about again waits for blocks at the head of its queue: its
        chunks below DRAM are promoted into DRAM now, once, in the background, so the step that
        loads it reads DRAM instead of waiting for SSD (the hint made when it arrived is
        spent on every queued request alike, and most of what it brings up is evicted again
        before the request is served)."""
        first = found.local // self.chunk  # (chunks vLLM holds itself are not loaded)
        tiers = found.tiers[first : found.chunks]  # (full chunks: a tail promotes with its load)
        if rid in self._promoted or all(t == "host" for t in tiers):
            return
        if self._hint_later(self._prefetch, found.keys[first : found.chunks], first, rid):
            self._promoted.add(rid)

    def _prefetch(self, keys: list[ChunkKey], first: int, rid: str) -> None:
        try:
            self._hint_client.prefetch(keys, first=first, request=rid)
        except DaemonUnavailable:
            pass
        except Exception:
            log.exception("kvtier: prefetch hint failed")

    def _hint_later(self, fn, *args) -> bool:  # type: ignore[no-untyped-def]
        """Send a hint on the hints' thread; dropped (counted, False) while :data:`MAX_HINTS`
        wait."""
        with self._hint_lock:
            if self._hints_waiting >= MAX_HINTS:
                self.hints_dropped += 1
                return False
            self._hints_waiting += 1

        def send() -> None:
            try:
                fn(*args)
            finally:
                with self._hint_lock:
                    self._hints_waiting -= 1

        self._hints.submit(send)
        return True

    def _queued(self, request, rid: str, tokens: list[int], hint: SessionHint | None) -> None:  # type: ignore[no-untyped-def]
        try:
            # (no prefetch now: its chunks are promoted when it waits at the queue's head,
            # :meth:`_promote_waiting` -- promoted now, a long queue's arrivals would evict
            # the chunks of the requests ahead of them, which are served first). The session
            # hint counts against the quota of its tenant, else of the request's cache_salt.
            salt = getattr(request, "cache_salt", None) or None
            if hint is not None and hint.tenant is None and salt:
                hint = dataclasses.replace(hint, tenant=salt)
            self._hint_client.queued(rid, self._full_keys(request, tokens), prefetch=False, hint=hint)
        except DaemonUnavailable:
            pass
        except Exception:  # a hint must never take the scheduler down
            log.exception("kvtier: queued hint failed")

    def _hint(self, what: str, rid: str) -> None:
        try:
            getattr(self._hint_client, what)(rid)
        except DaemonUnavailable:
            pass
        except Exception:
            log.exception("kvtier: %s hint failed", what)
