"""The store daemon as a service: the daemon and its HTTP port, wired together.

The HTTP port (``metrics_port``, on loopback: Prometheus metrics and the read-only lookup of
:mod:`kvtier.server.http`) is bound first, so that a port that cannot be bound fails before the
daemon creates its arena, its socket or its SSD lock (nothing is left behind). Until the daemon
is made, a lookup on it is answered 503.
"""

from __future__ import annotations

from kvtier.server.daemon import DaemonConfig, StoreDaemon
from kvtier.server.http import RenderChat, StoreHTTP
from kvtier.server.http_port import HTTPPort
from kvtier.server.metrics import Metrics


class StoreService:
    """A :class:`StoreDaemon` and its HTTP port (when ``metrics_port`` is set)."""

    def __init__(self, config: DaemonConfig, render_chat: RenderChat | None = None) -> None:
        self.daemon: StoreDaemon | None = None
        self.metrics_address: tuple[str, int] | None = None
        self.metrics: Metrics | None = None
        self._http: HTTPPort | None = None
        if config.metrics_port is not None:
            self.metrics = Metrics(lambda: self.daemon.snapshot())  # type: ignore[union-attr]
            app = StoreHTTP(lambda: self.daemon, self.metrics.registry, lookup=config.http_lookup,
                            render_chat=render_chat)
            self._http = HTTPPort(app, "127.0.0.1", config.metrics_port)
            self.metrics_address = self._http.address
        try:
            self.daemon = StoreDaemon(config, observe=self.metrics.observe if self.metrics else None)
        except BaseException:
            if self._http is not None:
                self._http.close()
            raise

    def start(self) -> StoreService:
        assert self.daemon is not None
        self.daemon.start()
        return self

    def serve_forever(self) -> None:
        assert self.daemon is not None
        self.daemon.serve_forever()

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
        if self.daemon is not None:
            self.daemon.stop()
