"""The store daemon as a service: the daemon and its metrics endpoint, wired together.

The metrics server is bound first, so that a port that cannot be bound fails before the daemon
creates its arena, its socket or its SSD lock (nothing is left behind).
"""

from __future__ import annotations

from kvtier.server.daemon import DaemonConfig, StoreDaemon
from kvtier.server.metrics import Metrics


class StoreService:
    """A :class:`StoreDaemon` and its Prometheus metrics (when ``metrics_port`` is set)."""

    def __init__(self, config: DaemonConfig) -> None:
        self.daemon: StoreDaemon | None = None
        self.metrics_address: tuple[str, int] | None = None
        holder: list[StoreDaemon] = []
        self.metrics = Metrics(lambda: holder[0].snapshot()) if config.metrics_port is not None else None
        if self.metrics is not None:
            self.metrics_address = self.metrics.serve("127.0.0.1", config.metrics_port)  # type: ignore[arg-type]
        try:
            self.daemon = StoreDaemon(config, observe=self.metrics.observe if self.metrics else None)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise
        holder.append(self.daemon)

    def start(self) -> StoreService:
        assert self.daemon is not None
        self.daemon.start()
        return self

    def serve_forever(self) -> None:
        assert self.daemon is not None
        self.daemon.serve_forever()

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.daemon is not None:
            self.daemon.stop()
