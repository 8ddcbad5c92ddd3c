"""The Mooncake client of :mod:`kvtier.tiers.mooncake`, with the timeouts and reconnection the
remote tiers promise, its error codes, and registered staging buffers."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import torch
from mooncake.store import MooncakeDistributedStore

from kvtier.errors import KVTierError
from kvtier.tiers.base import TierStats
from kvtier.tiers.remote_buffers import BufferPool
from kvtier.tiers.remote_config import MooncakeTierConfig, parse_address
from kvtier.tiers.remote_health import Health

T = TypeVar("T")
log = logging.getLogger(__name__)
CLOSE_WAIT_S = 35.0
"""How long ``close`` waits for calls given up on (Mooncake's own RPC and transfer timeouts are 30 s)."""

ERRORS = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND", -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (pool full)", -600: "INVALID_PARAMS", -700: "INVALID_WRITE",
    -701: "INVALID_READ", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
"""Mooncake Store's ``ErrorCode`` values (mooncake-store/include/types.h) that kvtier meets."""


class Unavailable(KVTierError):
    """A Mooncake call did not complete (already counted and logged by the tier)."""


def code_name(rc: int) -> str:
    return f"{ERRORS.get(rc, 'error')} ({rc})"


def is_outage(rc: int) -> bool:
    """Transfer and RPC failures: the master or the memory holder is down or unreachable."""
    return -999 <= rc <= -800 or rc in (-1010, -1011)


class Staging(BufferPool):
    """Buffers registered with one Mooncake client (Mooncake transfers from and into registered
    memory). A buffer handed to a call that was abandoned (timed out) is given back only once that
    call has ended; one given back after the client closed is just dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.store: MooncakeDistributedStore | None = None

    def _new(self, size: int) -> torch.Tensor:
        buf = super()._new(size)
        rc = self.store.register_buffer(buf.data_ptr(), size)  # type: ignore[union-attr]
        if rc != 0:
            raise Unavailable(f"register_buffer of {size} bytes: {code_name(rc)}")
        return buf

    def give(self, buf: torch.Tensor) -> None:
        if self.store is not None:
            super().give(buf)

    def _drop(self, buf: torch.Tensor) -> None:
        if self.store is not None:
            self.store.unregister_buffer(buf.data_ptr())


class MooncakeConnection:
    """One ``MooncakeDistributedStore`` with a deadline on every call.

    Calls run on worker threads and are abandoned after ``timeout_s`` (Mooncake's own RPC and
    transfer timeouts are 30 s; its data calls release the GIL, so the wait can be cut short).
    An abandoned call may still use its buffers later: callers give it buffers of its own. The
    client is set up lazily and again after a failed setup; while the master is unreachable,
    calls fail fast (:class:`Health`).
    """

    def __init__(self, config: MooncakeTierConfig, stats: TierStats) -> None:
        self.config = config
        self.health = Health(f"mooncake {config.master_address}", config.reconnect_interval_s, stats)
        self.staging = Staging()
        self._workers = ThreadPoolExecutor(config.workers, thread_name_prefix="kvtier-mooncake")
        self._store: MooncakeDistributedStore | None = None
        self._lock = threading.Lock()
        self._pending: set[Future] = set()  # calls given up on that may still run
        try:  # a master that is down is retried later, by the calls
            self.store("setup")
        except Unavailable:
            pass

    def _connect(self) -> MooncakeDistributedStore:
        """A set-up client. Mooncake's ``setup`` holds the GIL while it retries an absent master
        (about 4.5 s an attempt), so it is called only once a TCP connect to the master works;
        a master that accepts connections but never answers can still stall the process."""
        c = self.config
        socket.create_connection(parse_address(c.master_address, "master_address"), c.timeout_s).close()
        store = MooncakeDistributedStore()
        rc = store.setup(c.local_hostname, c.metadata_server, c.global_segment_bytes,
                         c.local_buffer_bytes, c.protocol, c.device_names, c.master_address)
        if rc != 0:
            raise ConnectionError(f"setup returned {code_name(rc)}")
        return store

    def store(self, what: str) -> MooncakeDistributedStore:
        """The set-up client, or Unavailable (counted, logged)."""
        store = self._store
        if store is not None and self.health.up:
            return store
        if not self.health.ready():
            raise Unavailable(what)
        with self._lock:
            if self._store is None:
                try:
                    self._store = self.staging.store = self._connect()
                except (OSError, ConnectionError) as exc:
                    self.health.failed(what, exc)
                    raise Unavailable(what) from exc
            return self._store

    def staging_for(self, what: str, size: int) -> torch.Tensor:
        """A registered staging buffer of at least ``size`` bytes, or Unavailable."""
        self.store(what)
        return self.staging.take(size)

    def call(self, what: str, fn: Callable[[MooncakeDistributedStore], T],
             abandoned: Callable[[Future], None] | None = None,
             staging: torch.Tensor | None = None,
             codes: Callable[[T], Iterable[object]] | None = None,
             during: Callable[[], None] | None = None) -> T:
        """``fn(store)`` on a worker; Unavailable (counted, logged) if down, failing or late.
        An int result (or an element of a list, or the last of a tuple, also of a tuple in a
        list) in Mooncake's outage range is a failure too; ``codes(result)``, if given, says
        which codes to look at instead. ``during()`` runs in the caller's thread while the call
        runs (work the call waits for, fed through a queue, say); it must not raise, and its time
        counts against the timeout. A call given up on a timeout may still run: ``abandoned`` then
        gets its future (done once the call has ended or was cancelled before it started).
        ``staging``: a buffer of :attr:`staging` that ``fn`` uses (and refers to, which keeps it
        alive while the call runs); when the call fails it goes back to the pool, at once or,
        for a call given up on, once that call has ended."""
        running: Future | None = None
        try:
            deadline = time.monotonic() + self.config.timeout_s
            future = self._workers.submit(fn, self.store(what))
            if during is not None:
                during()
            try:
                result = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                if not future.cancel():
                    running = future
                    with self._lock:
                        self._pending.add(future)
                    future.add_done_callback(self._ended)
                if abandoned is not None:
                    abandoned(future)
                self.health.failed(what, f"no answer within {self.config.timeout_s}s")
                raise Unavailable(what) from None
            except Exception as exc:  # a binding error is a failed call, not a crash
                self.health.failed(what, exc)
                raise Unavailable(what) from exc
            found = codes(result) if codes is not None else [
                r[-1] if isinstance(r, tuple) else r for r in (result if isinstance(result, list) else [result])]
            failed = next((rc for rc in found if isinstance(rc, int) and is_outage(rc)), None)
            if failed is not None:
                self.health.failed(what, code_name(failed))
                raise Unavailable(what)
        except Unavailable:
            if staging is not None and running is not None:
                running.add_done_callback(lambda _: self.staging.give(staging))
            elif staging is not None:
                self.staging.give(staging)
            raise
        self.health.succeeded()
        return result

    def _ended(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def close(self) -> None:
        """Close the client once the calls given up on have ended (they may still write into
        buffers registered with it), waiting at most ``CLOSE_WAIT_S``; past that the client is
        left open, not closed under a running call."""
        self._workers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            pending = list(self._pending)
        _, running = wait(pending, timeout=CLOSE_WAIT_S)
        with self._lock:
            store, self._store = self._store, None
        if store is None:
            return
        if running:
            log.warning("mooncake: %d calls given up on are still running; the client is left open",
                        len(running))
            return
        self.staging.clear()
        self.staging.store = None
        store.close()
