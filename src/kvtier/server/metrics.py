"""Prometheus metrics of the store daemon, read from the store's own counters at scrape time.

Own registry (never the process-global one), served on loopback by ``prometheus_client``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvtier.server.daemon import StoreDaemon


class _StoreCollector(Collector):
    def __init__(self, daemon: StoreDaemon) -> None:
        self._daemon = daemon

    def collect(self) -> Iterator[Metric]:
        snap = self._daemon.snapshot()
        tiers: dict[str, dict[str, object]] = snap["tiers"]  # type: ignore[assignment]
        fams = {
            "hits": CounterMetricFamily("kvtier_hits", "Looked-up chunks served by the tier", labels=["tier"]),
            "misses": CounterMetricFamily("kvtier_misses", "Looked-up chunks the tier did not serve", labels=["tier"]),
            "evictions": CounterMetricFamily("kvtier_evictions", "Chunks evicted from the tier", labels=["tier"]),
            "bytes_read": CounterMetricFamily("kvtier_bytes_read", "Bytes read from the tier", labels=["tier"]),
            "bytes_written": CounterMetricFamily("kvtier_bytes_written", "Bytes written to the tier", labels=["tier"]),
            "errors": CounterMetricFamily("kvtier_errors", "I/O errors and damaged chunks", labels=["tier"]),
        }
        ratio = GaugeMetricFamily("kvtier_hit_ratio", "hits / (hits + misses) per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvtier_capacity_bytes", "Tier capacity", labels=["tier"])
        used = GaugeMetricFamily("kvtier_used_bytes", "Tier bytes in use", labels=["tier"])
        chunks = GaugeMetricFamily("kvtier_chunks", "Chunks held by the tier", labels=["tier"])
        for name, t in tiers.items():
            io: dict[str, int] = t["io"]  # type: ignore[assignment]
            hits, misses = int(t["hits"]), int(t["misses"])  # type: ignore[call-overload]
            fams["hits"].add_metric([name], hits)
            fams["misses"].add_metric([name], misses)
            fams["evictions"].add_metric([name], int(t["evictions"]))  # type: ignore[call-overload]
            fams["bytes_read"].add_metric([name], io["bytes_read"])
            fams["bytes_written"].add_metric([name], io["bytes_written"])
            fams["errors"].add_metric([name], io["errors"])
            ratio.add_metric([name], hits / (hits + misses) if hits + misses else 0.0)
            cap.add_metric([name], int(t["capacity_bytes"]))  # type: ignore[call-overload]
            used.add_metric([name], int(t["used_bytes"]))  # type: ignore[call-overload]
            chunks.add_metric([name], int(t["chunks"]))  # type: ignore[call-overload]
        yield from fams.values()
        yield from (ratio, cap, used, chunks)
        yield CounterMetricFamily("kvtier_prefetches", "Chunks promoted SSD->DRAM", value=int(snap["promotions"]))  # type: ignore[call-overload]
        yield CounterMetricFamily("kvtier_demotions", "Chunks demoted DRAM->SSD", value=int(snap["demotions"]))  # type: ignore[call-overload]
        yield CounterMetricFamily("kvtier_load_failures", "Promised chunks that could not be read", value=int(snap["load_failures"]))  # type: ignore[call-overload]
        yield GaugeMetricFamily("kvtier_clients", "Connected clients", value=int(snap["clients"]))  # type: ignore[call-overload]
        yield GaugeMetricFamily("kvtier_pinned_chunks", "Chunks pinned by clients", value=int(snap["pinned_chunks"]))  # type: ignore[call-overload]


class Metrics:
    """The daemon's registry: store counters plus per-operation latency."""

    def __init__(self, daemon: StoreDaemon) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(daemon))
        self.latency = Histogram(
            "kvtier_op_seconds", "Daemon operation latency (acquire = load, commit = save)",
            ["op"], registry=self.registry,
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
        )
        self._server = None

    def observe(self, op: str, seconds: float) -> None:
        self.latency.labels(op=op).observe(seconds)

    def serve(self, host: str, port: int) -> tuple[str, int]:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return host, server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
