"""Prometheus metrics of the store daemon, read from a snapshot of its counters at scrape time.

Own registry (never the process-global one), served on loopback with the daemon's HTTP
lookup (:mod:`kvtier.server.http`). It knows nothing of the daemon: it is handed a function that
returns the daemon's snapshot (:mod:`kvtier.server.service` wires the two).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

Snapshot = Callable[[], dict[str, object]]


class _StoreCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        tiers: dict[str, dict[str, object]] = snap["tiers"]  # type: ignore[assignment]
        fams = {
            "hits": CounterMetricFamily("kvtier_hits", "Looked-up chunks found in the tier (offered to engines)", labels=["tier"]),
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
        took = CounterMetricFamily("kvtier_engine_tokens", "Tokens engines took from kvtier, by the tier they were found in", labels=["tier"])
        for name, n in dict(snap.get("loaded_tokens", {})).items():  # type: ignore[call-overload]
            took.add_metric([name], int(n))
        yield took

        def count(name: str, doc: str, key: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=int(snap.get(key, 0)))  # type: ignore[call-overload]

        def gauge(name: str, doc: str, key: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=int(snap.get(key, 0)))  # type: ignore[call-overload]

        yield count("kvtier_engine_had_tokens", "Tokens engines already held themselves when they looked up", "had_tokens")
        yield count("kvtier_engine_load_failures", "Chunks engines reported they could not load (recomputed)", "engine_load_failures")
        yield count("kvtier_lookup_tokens", "Tokens looked up", "lookup_tokens")
        yield count("kvtier_hit_tokens", "Tokens lookups found cached", "hit_tokens")
        yield count("kvtier_prefetches", "Chunks promoted into DRAM by prefetches (scheduler hints)", "prefetched")
        yield count("kvtier_promotions", "Chunks promoted into DRAM (prefetches and loads)", "promotions")
        yield count("kvtier_demotions", "Chunks demoted DRAM->SSD", "demotions")
        yield count("kvtier_load_failures", "Promised chunks no tier could read", "load_failures")
        yield count("kvtier_busy_chunks", "Chunks not written because another writer was writing them", "busy_chunks")
        yield count("kvtier_refused_clients", "Connections refused (too many clients)", "refused_clients")
        yield count("kvtier_hints_accepted", "Session hints accepted", "hints_accepted")
        yield count("kvtier_hints_refused", "Session hints whose retention their tenant's quota refused", "hints_refused")
        yield count("kvtier_sessions_done", "Hinted sessions ended by a done hint", "sessions_done")
        yield count("kvtier_hint_stagings", "Retained sessions prefetched into DRAM ahead of their expected return", "hint_stagings")
        yield count("kvtier_hint_staged_chunks", "Chunks those stagings promoted into DRAM", "hint_staged_chunks")
        yield gauge("kvtier_sessions_retained", "Hinted sessions retained now", "sessions_retained")
        yield gauge("kvtier_clients", "Connected clients", "clients")
        yield gauge("kvtier_pinned_chunks", "Chunks pinned by clients' read leases", "pinned_chunks")
        yield gauge("kvtier_writes_in_flight", "DRAM slots reserved by clients' write leases", "writes_in_flight")
        yield gauge("kvtier_orphaned_writes", "DRAM slots of write leases whose connection ended, held until nothing can write them", "orphaned_writes")


class Metrics:
    """The daemon's registry: store counters plus per-operation latency."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(snapshot))
        self.latency = Histogram(
            "kvtier_op_seconds", "Daemon operation latency (acquire = load, commit = save)",
            ["op"], registry=self.registry,
            buckets=(1e-5, 3e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
        )

    def observe(self, op: str, seconds: float) -> None:
        self.latency.labels(op=op).observe(seconds)


__all__ = ["Metrics"]
