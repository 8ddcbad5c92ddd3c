"""The daemon's connections: a thread per connection that is talking, none for one that is idle.

One event-loop thread accepts connections and watches the *parked* ones (idle: no request for
:data:`PARK_S`) with epoll. When a parked connection becomes readable, it is handed to a worker
thread, which serves its requests one after the other -- reading each whole, handling it,
writing the reply -- for as long as the next one comes within :data:`PARK_S` (after a hello,
only if it is there already), then parks it again and is free for another connection. So a busy client (a vLLM worker stepping every few
milliseconds) keeps a thread and pays no hand-over per request, and thousands of idle clients
cost a file descriptor each. Worker threads are made when every one is busy and exit after
:data:`WORKER_IDLE_S` without work: as many threads as connections talking at once.

A connection the daemon refuses (``max_clients``) is answered by the event loop itself: it
reads the client's hello without blocking, writes the refusal and closes, and closes one that
says nothing within :data:`REFUSED_S`. It never takes a thread.

A request must arrive whole within :data:`READ_TIMEOUT_S` of its first byte (a client that
sends half a message and stalls is dropped, its leases ended as on any disconnect).
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from kvtier.server import protocol

log = logging.getLogger(__name__)

PARK_S = 1.0
"""A connection idle this long gives its thread back."""
READ_TIMEOUT_S = 30.0
WORKER_IDLE_S = 2.0
REFUSED_S = 5.0
MAX_REFUSED = 1024
"""Refused connections waiting to say hello at most (more are closed at once)."""

S = TypeVar("S")


class _Workers:
    """Threads that run submitted work: a new one when none is idle; one idle for
    :data:`WORKER_IDLE_S` exits."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._count = 0

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if spawn:
                self._threads += 1
                self._count += 1
                n = self._count
            else:
                self._idle -= 1  # this one is taken
        self._work.put(fn)
        if spawn:
            threading.Thread(target=self._run, name=f"{self._name}-{n}", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                fn = self._work.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # nobody counted on this thread: it may go
                        self._idle -= 1
                        self._threads -= 1
                        return
                continue  # a submit took this thread just now: its work is coming
            if fn is None:
                with self._lock:
                    self._threads -= 1
                return
            try:
                fn()
            except Exception:  # never let one connection's failure kill the thread
                log.exception("kvtier daemon: serving a connection failed")
            with self._lock:
                self._idle += 1

    @property
    def threads(self) -> int:
        with self._lock:
            return self._threads


class _Refused:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + REFUSED_S
        self.buf = bytearray()


class Connections(Generic[S]):
    """Accepts on ``listener`` and serves its connections. ``accepted(sock)`` makes a new
    connection's session (None: refuse it, answered with ``refusal()``); ``serve(session,
    request)`` returns the reply; ``ended(session)`` is called once when the connection is gone.
    The session must have a ``sock`` attribute."""

    def __init__(self, listener: socket.socket, serve: Callable[[S, dict[str, object]], dict[str, object]],
                 accepted: Callable[[socket.socket], S | None], ended: Callable[[S], None],
                 refusal: Callable[[], dict[str, object]]) -> None:
        self._listener = listener
        self._serve = serve
        self._accepted = accepted
        self._ended = ended
        self._refusal = refusal
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._parked: queue.SimpleQueue[S] = queue.SimpleQueue()
        self._workers = _Workers("kvtier-daemon")
        self._lock = threading.Lock()
        self._live: set[S] = set()
        self._refused: dict[int, _Refused] = {}
        self._stopping = False
        self._closed = False
        self._running = threading.Event()
        self._exited = threading.Event()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)

    # -- the event loop -----------------------------------------------------------------------
    def run(self) -> None:
        """Serve until :meth:`stop` (in this thread)."""
        self._running.set()
        try:
            while not self._stopping:
                for key, _ in self._sel.select(timeout=1.0):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj == self._wake_r:
                        self._woken()
                    elif isinstance(key.data, _Refused):
                        self._refused_readable(key.data)
                    else:
                        self._readable(key.data)
                self._expire_refused()
        finally:
            self._exited.set()

    def _accept(self) -> None:
        for _ in range(256):  # a burst; the rest on the next round
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # out of fds or memory, or a connection that failed while queued (ECONNABORTED,
                # EPROTO...): the loop goes on serving the others, never ends the daemon
                log.warning("kvtier daemon: cannot accept a connection: %s", exc)
                time.sleep(0.05)  # the backlog waits; accepting again at once would spin
                return
            sock.setblocking(True)
            session = self._accepted(sock)
            if session is None:
                self._refuse(sock)
                continue
            # blocking, no Python timeout (it polls before every read: a thread hand-over more
            # per request); the kernel's timeouts bound reads (set per read) and writes
            sock.settimeout(None)
            with self._lock:
                self._live.add(session)
            self._sel.register(sock, selectors.EVENT_READ, session)

    def _readable(self, session: S) -> None:
        self._sel.unregister(session.sock)  # type: ignore[attr-defined]
        self._workers.submit(lambda: self._talk(session))

    def _woken(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                session = self._parked.get_nowait()
            except queue.Empty:
                return
            if self._stopping:
                self._end(session)
            else:
                self._sel.register(session.sock, selectors.EVENT_READ, session)  # type: ignore[attr-defined]

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # a wake-up is pending already

    # -- refused connections ------------------------------------------------------------------
    def _refuse(self, sock: socket.socket) -> None:
        if len(self._refused) >= MAX_REFUSED:
            sock.close()
            return
        sock.setblocking(False)
        r = _Refused(sock)
        self._refused[sock.fileno()] = r
        self._sel.register(sock, selectors.EVENT_READ, r)

    def _refused_readable(self, r: _Refused) -> None:
        try:
            part = r.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            part = b""
        r.buf += part
        head = protocol.HEADER.size
        whole = len(r.buf) >= head and len(r.buf) >= head + protocol.HEADER.unpack_from(r.buf)[0]
        if part and not whole and len(r.buf) < 65536:
            return
        if whole:
            try:
                protocol.send(r.sock, self._refusal())  # small: the socket's buffer takes it at once
            except (OSError, protocol.ProtocolError):
                pass
        self._close_refused(r)

    def _close_refused(self, r: _Refused) -> None:
        self._refused.pop(r.sock.fileno(), None)
        try:
            self._sel.unregister(r.sock)
        except (KeyError, ValueError):
            pass
        r.sock.close()

    def _expire_refused(self) -> None:
        if self._refused:
            now = time.monotonic()
            for r in [r for r in self._refused.values() if r.deadline <= now]:
                self._close_refused(r)

    # -- a talking connection (a worker thread) ------------------------------------------------
    def _talk(self, session: S) -> None:
        sock: socket.socket = session.sock  # type: ignore[attr-defined]
        idle_s = PARK_S  # handed over readable: its request is there
        try:
            while True:
                try:
                    request = protocol.recv_request(sock, idle_s, READ_TIMEOUT_S)
                except (protocol.ProtocolError, OSError) as exc:
                    if not self._stopping:
                        log.warning("dropping a client: %s", exc)
                    self._end(session)
                    return
                if request is protocol.IDLE:  # nothing within PARK_S: park it, free the thread
                    with self._lock:
                        stopping = self._stopping
                        if not stopping:
                            self._parked.put(session)
                    if stopping:
                        self._end(session)
                    else:
                        self._wake()
                    return
                if request is None:
                    self._end(session)
                    return
                assert isinstance(request, dict)
                reply = self._serve(session, request)
                try:
                    protocol.send(sock, reply, READ_TIMEOUT_S)  # read in time, however slowly
                except (OSError, protocol.ProtocolError):
                    self._end(session)
                    return
                # after a hello, park at once unless the next request is there already: a burst
                # of new clients (a thousand engines starting) must not take a thread each
                idle_s = 0.0 if request.get("op") == "hello" else PARK_S
        except BaseException:
            self._end(session)
            raise

    def _end(self, session: S) -> None:
        with self._lock:
            if session not in self._live:
                return
            self._live.discard(session)
        try:
            session.sock.close()  # type: ignore[attr-defined]
        except OSError:
            pass
        try:
            self._ended(session)
        except Exception:
            log.exception("kvtier daemon: ending a connection failed")

    # -- stop ---------------------------------------------------------------------------------
    @property
    def threads(self) -> int:
        return self._workers.threads

    def stop(self) -> None:
        """Stop accepting, end every connection (as a crash would: their leases end)."""
        if self._closed:
            return
        with self._lock:  # after this, no worker parks a connection: it ends it
            self._stopping = True
        self._wake()
        if self._running.is_set():
            self._exited.wait(5)
        self._closed = True
        with self._lock:
            live = list(self._live)
        for session in live:  # the ones a worker serves see their socket end
            try:
                session.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
            except OSError:
                pass
        parked = []
        for key in list(self._sel.get_map().values()):
            if key.data is not None and not isinstance(key.data, _Refused):
                parked.append(key.data)
        while True:
            try:
                parked.append(self._parked.get_nowait())
            except queue.Empty:
                break
        for session in parked:
            self._end(session)
        for r in list(self._refused.values()):
            self._close_refused(r)
        self._sel.close()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
