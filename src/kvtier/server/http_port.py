"""The server of the daemon's HTTP port (:mod:`kvtier.server.http`): threads of its own, and the
bounds on what an anonymous connection may cost -- how many at once, how long a read, how long
a connection (the module's threat model).
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

if TYPE_CHECKING:
    from kvtier.server.http import StoreHTTP

MAX_CONCURRENT = 32
"""Connections served at once; one beyond them is answered 503 at once."""
READ_TIMEOUT_S = 10.0
REQUEST_DEADLINE_S = 15.0
"""A connection is cut this long after it was accepted (one that trickles bytes included)."""


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # a client that stalls mid-request loses its connection

    def setup(self) -> None:
        super().setup()
        # a client that trickles a byte every few seconds never hits the read timeout: the
        # whole connection has a deadline
        self._cut = threading.Timer(REQUEST_DEADLINE_S, self._shutdown)
        self._cut.daemon = True
        self._cut.start()

    def _shutdown(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self) -> None:
        self._cut.cancel()
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        """A router polling every few milliseconds must not fill the daemon's log."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def process_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        if not self._slots.acquire(blocking=False):
            try:  # busy: said at once (a scraper sees why), never queued
                request.settimeout(0.5)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
                                b"Content-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HTTPPort:
    """``app`` served on ``host:port`` by threads of its own (0: any free port)."""

    def __init__(self, app: StoreHTTP, host: str, port: int) -> None:
        try:
            self._server = make_server(host, port, app, server_class=_Server, handler_class=_Handler)  # type: ignore[arg-type]
        except (OSError, OverflowError) as exc:
            raise ValueError(f"cannot serve metrics on {host}:{port}: {exc}") from None
        self.address: tuple[str, int] = (host, int(self._server.server_address[1]))
        threading.Thread(target=self._server.serve_forever, args=(0.2,), name="kvtier-http", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


__all__ = ["HTTPPort"]
