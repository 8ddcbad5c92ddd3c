"""Daemon calls made for vLLM's engine loop, which must never wait on the daemon for long.

vLLM calls the connector inside its engine loop: the scheduler's lookups between steps, the
worker's loads and saves inside a step. A daemon that is stalled (SIGSTOPped, a lock held for
seconds, a machine swapping) must cost that loop at most a small, bounded wait, then a miss --
never a multi-second stall of every running request's decoding.

:class:`Calls` runs a :class:`~kvtier.server.client.StoreClient`'s calls on a thread of its own,
in the order they were made, with the client's own (long) timeout; the loop waits for each at
most a bounded time. A call the loop gave up on still completes on that thread, and what it
holds is then ended there (a lease that came back late is released or abandoned: ``late``), so
no lease is left behind and none is sent again behind the caller's back. While a call has been
running for longer than the loop would wait, the daemon is taken as stalled: further waits are
skipped at once (a miss now, not one bounded wait per request of the step).

Waits add up: a step may hold several loads and saves, each with a call the loop would wait
for. :meth:`Calls.begin_step` gives the step one budget for all of them: every wait is cut to
what is left of it, so the loop never waits on the daemon longer than that in one step, however
many calls the step makes (what is not back by then is a miss).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

_LATE = object()
"""A call the step stopped waiting for."""


class Calls:
    """One thread making daemon calls in order; bounded waits for their results."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._pending = 0
        self._since: float | None = None
        """When the call now at the head of the queue started (None: none is running)."""
        self.gave_up = 0
        """Calls whose result the loop stopped waiting for."""
        self.skipped = 0
        """Waits skipped at once because the daemon was stalled."""
        self._left: float | None = None
        """What is left of the step's budget for waits (None: no budget, each wait its own)."""
        self.waits = 0
        self.wait_s = 0.0
        """Times the caller (vLLM's engine loop) blocked on a call not done yet, and the seconds
        it blocked in all: what a profile counts as the loop waiting on the daemon."""

    def begin_step(self, budget_s: float | None) -> None:
        """A new step: its waits, all together, last at most ``budget_s`` (None: no budget)."""
        self._left = budget_s

    @property
    def left(self) -> float:
        """Seconds of the step's budget not waited yet (inf without a budget)."""
        return float("inf") if self._left is None else self._left

    def stalled(self, after_s: float) -> bool:
        """Whether a call has been running for longer than ``after_s`` (the daemon is slow or
        stopped: waiting for another one would only add a wait to the loop)."""
        with self._lock:
            return self._since is not None and time.monotonic() - self._since > after_s

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` after the calls submitted before it."""
        with self._lock:
            self._pending += 1

        def run() -> T:
            with self._lock:
                self._since = time.monotonic()
            try:
                return fn()
            finally:
                with self._lock:
                    self._pending -= 1
                    self._since = None

        future = self._pool.submit(run)

        def cancelled(f: Future[T]) -> None:  # cancelled before it ran: it is not pending
            if f.cancelled():
                with self._lock:
                    self._pending -= 1

        future.add_done_callback(cancelled)
        return future

    def wait(self, future: Future[T], wait_s: float, default: T,
             late: Callable[[T], None] | None = None) -> T:
        """``future``'s result if it is done within ``wait_s``, else ``default``; a result that
        comes after that is passed to ``late`` (on the calls' thread), which ends whatever it
        holds. A call that raised is ``default``. ``wait_s`` is cut to what is left of the
        step's budget (:meth:`begin_step`), and the wait taken from it."""
        wait_s = min(wait_s, self.left)
        if not future.done() and wait_s > 0:
            t0 = time.perf_counter()
            futures_wait([future], timeout=wait_s)
            waited = time.perf_counter() - t0
            self.waits += 1  # (the caller's thread only)
            self.wait_s += waited
            if self._left is not None:
                self._left = max(0.0, self._left - waited)
        try:
            return future.result(timeout=0)
        except FutureTimeout:
            with self._lock:
                self.gave_up += 1
            if late is not None:
                self.when_done(future, late)
            return default
        except Exception:
            log.exception("kvtier: a daemon call failed")
            return default

    def when_done(self, future: Future[T], fn: Callable[[T], None]) -> None:
        """Pass ``future``'s result to ``fn`` on the calls' thread once it is done (never on
        the caller's: ``fn`` talks to the daemon, and the caller must not wait on it); not if
        the call failed."""
        def dispatch(f: Future[T]) -> None:
            try:
                self.submit(lambda: self._late(f, fn))  # (in order, counted as any call)
            except RuntimeError:  # shut down: the connection's end ends what it held
                pass

        future.add_done_callback(dispatch)

    @staticmethod
    def _late(future: Future[T], late: Callable[[T], None]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        try:
            late(future.result())
        except Exception:
            log.exception("kvtier: ending a late daemon reply failed")

    def call(self, fn: Callable[[], T], wait_s: float, default: T,
             late: Callable[[T], None] | None = None) -> T:
        """``fn()``'s result within ``wait_s``, or ``default`` (see :meth:`wait`). While the
        daemon is stalled, ``default`` at once, and ``fn`` is not called at all."""
        if self.stalled(wait_s):
            with self._lock:
                self.skipped += 1
            return default
        return self.wait(self.submit(fn), wait_s, default, late)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every call submitted so far is done; False on timeout."""
        try:
            self._pool.submit(lambda: None).result(timeout)
            return True
        except FutureTimeout:
            return False

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
