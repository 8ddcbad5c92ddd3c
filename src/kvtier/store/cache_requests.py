"""Requests (the policies' notion of a use) and session hints: a request ``queued``, ``started``
and ``finished`` numbered for the policies (:mod:`kvtier.store.request_numbers`); a hinted
``queued`` recorded in the session book (:mod:`kvtier.core.sessions`: the rules); the retained
sessions staged into DRAM ahead of their expected return -- at each ``started`` and, so that an
idle store stages too, on a light periodic tick (a thread started with the first hint, stopped
by ``close``). A part of :class:`~kvtier.store.cache.ChunkCache`, under its one lock (see
:mod:`kvtier.store.cache`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.core.session_hints import SessionHint
from kvtier.core.session_state import Staging
from kvtier.store.config import NOMINAL_CHUNK_BYTES

log = logging.getLogger(__name__)

TICK_S = 0.15
"""How often an idle store looks for retained sessions due in DRAM (and expired ones)."""


class CacheRequests:
    """:class:`~kvtier.store.cache.ChunkCache`'s request hooks and session hints."""

    def queued(self, request_id: str, keys: Sequence[ChunkKey], *, entry: Shape | None = None,
               wait: bool = True, tenant: str | None = None, prefetch: bool = True,
               hint: SessionHint | None = None) -> int:
        """A request arrived and waits to be served; it will need ``keys`` (a prefix). It gets
        the next number in arrival order, the policies with a look-ahead hear of it, and its
        held chunks are prefetched into DRAM (now, or with ``wait=False`` in the background;
        not with ``prefetch=False``: a scheduler that promotes a request's chunks itself when
        it comes to the head of its queue). Returns how many were promoted (0 when not waited
        for). ``hint``: the request's session hint (checked already), recorded for placement
        (:mod:`kvtier.core.sessions`; its quota is ``hint.tenant``'s, else ``tenant``'s, else
        the shared tenant's: a refusal is counted, the request served all the same)."""
        with self._section:
            seq = self._requests.queued(request_id)
            if self.placement.lookahead:
                self.placement.hint(seq, list(keys), time.monotonic())
            if hint is not None:
                self._hinted(seq, keys, hint, tenant, entry)
        if not prefetch:
            return 0
        return self.prefetch(keys, use=seq, entry=entry, wait=wait, tenant=tenant)

    def started(self, request_id: str) -> int:
        """The request is being served (before its lookup): the policies ``begin`` it. A request
        never announced with :meth:`queued` gets its number now. Requests are assumed to start
        roughly in arrival order: starting one also ends the look-ahead protection of those that
        arrived before it. The hinted sessions due in DRAM, then what the DRAM policy stages
        (conversations it predicts are coming back, see
        :meth:`~kvtier.core.policies.base.EvictionPolicy.staging`; never at the expense of a
        retained session's chunk), are prefetched in the background, as a hint is. Returns its
        number, the ``use`` of its touches."""
        staged: list[Sequence[ChunkKey]] = []
        due: list[Staging] = []
        with self._section:
            seq, new = self._requests.started(request_id)
            if new:
                now = time.monotonic()
                self.placement.begin(seq, now)
                due = self._due(now)
                staged = self.placement.staging(now)
        self._stage(due)
        for keys in staged:  # outside the lock: queueing takes it
            self._stage_guess(keys)
        return seq

    def use_of(self, request_id: str | None, *, finished: bool = False) -> int | None:
        """The number of a queued or started request, with ``finished`` also of one finished
        lately (a save of its reply after its end); None for an unknown one. A few dict reads,
        without the lock: a lookup does not wait for it."""
        return self._requests.use_of(request_id, finished=finished)

    def arrived(self, request_id: str | None) -> int | None:
        """:meth:`use_of`, a request not known yet numbered as queued now (its lookup came
        before its :meth:`queued` hint, which then finds it: one use of each chunk, not two)."""
        seq = self._requests.use_of(request_id)
        if seq is None and request_id is not None:
            with self._section:
                seq = self._requests.queued(request_id)
        return seq

    def finished(self, request_id: str) -> None:
        """The request's reply is done (the policies hear when: a conversation's next turn
        comes a think time after it), or it was aborted before it started (its session, told
        when it was queued, hears of its end too)."""
        with self._section:
            seq = self._requests.finished(request_id)
            if seq is not None:
                now = time.monotonic()
                self.placement.finished(seq, now)
                if self.sessions.tracking:
                    self.sessions.finished(seq, now)

    # -- session hints ------------------------------------------------------------------------
    def _hinted(self, seq: int, keys: Sequence[ChunkKey], hint: SessionHint, tenant: str | None,
                entry: Shape | None) -> None:
        """Request ``seq`` carries ``hint`` (under the lock). Its session and quota are the
        request's tenant's (``tenant``, the one its keys are under, which the daemon checked the
        caller may use; else the shared tenant's), within it the hint's ``tenant`` (a
        ``cache_salt``) when it has one: a salt never reaches another tenant's sessions or
        quota."""
        chunk = entry or self.config.chunk
        scope = tenant or ""
        if hint.tenant is not None:
            scope = f"{scope}\x00{hint.tenant}"
        self.sessions.hinted(seq, keys, hint, scope,
                             weight=chunk.nbytes if chunk is not None else NOMINAL_CHUNK_BYTES,
                             entry=entry, key_tenant=tenant)
        if self._ticks is None and not self._closed:
            self._ticks = threading.Thread(target=self._tick, name="kvtier-sessions", daemon=True)
            self._ticks.start()

    def _due(self, now: float) -> list[Staging]:
        """The retained sessions to stage now (under the lock); none without a lower tier."""
        if not self.sessions.tracking or self.placement.levels < 2:
            return []
        return self.sessions.due(now)

    def _stage(self, due: Sequence[Staging]) -> None:
        """Prefetch each due session into DRAM in the background, evicting only what ranks
        before it (outside the lock: queueing takes it). Dropped, counted, as any prefetch when
        too many wait."""
        for st in due:
            def work(st: Staging = st) -> int:
                with self._section, self._shaped(st.entry, st.tenant), self.sessions.ceiling(st.expected):
                    promoted = self.placement.prefetch(st.keys)
                    self.sessions.stats.staged_chunks += promoted
                    return promoted

            self._in_background(work)

    def _stage_guess(self, keys: Sequence[ChunkKey]) -> None:
        """Prefetch what the DRAM policy stages in the background, as a hint is, evicting no
        retained session's chunk (only doomed and unhinted ones): a session's hint outranks the
        policy's guess, and a guess must not thrash against the hints' own staging."""
        keys = list(keys)

        def work() -> int:
            with self._section, self.sessions.ceiling(math.inf):
                return self.placement.prefetch(keys)

        self._in_background(work)

    def _tick(self) -> None:
        while not self._stop_ticks.wait(TICK_S):
            try:
                with self._section:
                    due = self._due(time.monotonic())
                self._stage(due)
            except Exception:  # the tick must outlive a bad turn
                log.exception("kvtier session staging failed")

    def _close_ticks(self) -> None:
        self._stop_ticks.set()
        if self._ticks is not None:
            self._ticks.join()

    def hint_counters(self) -> dict[str, int]:
        """What the session hints did (under the lock): see :class:`~kvtier.core.session_state.HintStats`."""
        st = self.sessions.stats
        return {"hints_accepted": st.accepted, "hints_refused": st.refused,
                "sessions_retained": self.sessions.retained, "sessions_done": st.done,
                "hint_stagings": st.stagings, "hint_staged_chunks": st.staged_chunks}
