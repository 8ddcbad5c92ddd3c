"""kvtier's figures in vLLM's own metrics: the log line and ``/metrics``.

Both halves of the connector count as they go; vLLM asks each for its stats after every step
(``get_kv_connector_stats``: the scheduler's and the workers' are summed), carries them to the
API server, and there hands them to :class:`KVTierPromMetrics` (Prometheus, one child per
engine) and to its periodic log ("KV Transfer metrics: ..."). vLLM collects them only while it
logs stats (not with ``--disable-log-stats``; an offline ``LLM`` does not by default).

Metrics (``model_name`` and ``engine`` labels as vLLM's own; counters end in ``_total``):

- ``vllm:kvtier_lookups_total`` lookups made (one dropped before it was sent included);
  ``vllm:kvtier_lookup_timeouts_total`` requests that missed because the daemon had not
  answered in time or was stalled (then no call is made);
- ``vllm:kvtier_hit_tokens_total{tier=...}`` tokens of the loads planned from kvtier, by the tier
  they were found in (``host``, ``disk``, a remote tier's name; a load that then fails is in
  ``load_failures`` too; a request preempted and loaded again counts again);
- ``vllm:kvtier_load_failures_total`` requests whose load failed (their blocks recomputed),
  ``vllm:kvtier_load_error_blocks_total`` their blocks, as each tensor-parallel rank reports
  them (summed over the ranks);
- ``vllm:kvtier_loaded_bytes_total``, ``vllm:kvtier_saved_bytes_total`` bytes copied between
  vLLM's blocks and the daemon's DRAM; ``vllm:kvtier_saves_skipped_total`` chunk saves a worker
  skipped because the daemon was slow (planned again);
- ``vllm:kvtier_preemptions_total``; ``vllm:kvtier_hints_dropped_total``;
  ``vllm:kvtier_hints_malformed_total`` requests served without their malformed session hint;
- ``vllm:kvtier_save_backlog_requests`` (gauge): finished requests whose save still holds their
  blocks.

This module imports nothing heavy: vLLM's API server imports the connector's class to build
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

HIT_PREFIX = "hit_tokens:"
"""``data`` keys of tokens taken from a tier: ``hit_tokens:<tier>``."""

COUNTERS: dict[str, str] = {
    "lookups": "Lookups kvtier made of its daemon",
    "lookup_timeouts": "Requests that missed because kvtier's daemon had not answered in time or was stalled",
    "load_failures": "Requests whose load from kvtier failed (their blocks were recomputed)",
    "load_error_blocks": "Blocks whose load from kvtier failed (summed over tensor-parallel ranks)",
    "loaded_bytes": "Bytes copied from kvtier's DRAM into vLLM's blocks",
    "saved_bytes": "Bytes copied from vLLM's blocks into kvtier's DRAM",
    "saves_skipped": "Saves a worker skipped because the daemon was slow or DRAM had no room for all (planned again)",
    "chunks_busy": "Chunks a save found another writer writing (planned again; summed over ranks)",
    "saves_vetoed": "Saves some rank of a multi-rank engine voted against (no rank committed them)",
    "preemptions": "Requests vLLM preempted while kvtier followed them",
    "hints_dropped": "Scheduler hints dropped while too many waited",
    "hints_malformed": "Requests served without their malformed session hint",
}
GAUGES: dict[str, str] = {
    "save_backlog_requests": "Finished requests whose save to kvtier still holds their blocks",
}


@dataclass
class KVTierStats(KVConnectorStats):
    """``data``: counter deltas since the last report (str -> number), plus gauges' last values."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for key, value in (other.data or {}).items():
            if key in GAUGES:
                self.data[key] = value  # the later report's value
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if v}

    def is_empty(self) -> bool:
        return not self.data  # (a gauge gone back to 0 is news)


class Deltas:
    """Cumulative counts in, the change since the last call out (None when nothing changed:
    vLLM treats any stats object as something to carry)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def since_last(self, now: dict[str, float], gauges: dict[str, float] | None = None) -> KVTierStats | None:
        data: dict[str, Any] = {}
        for key, value in now.items():
            d = value - self._last.get(key, 0)
            if d:
                data[key] = d
        for key, value in (gauges or {}).items():
            if value != self._last.get(key, 0):
                data[key] = value
        self._last = {**now, **(gauges or {})}
        return KVTierStats(data=data) if data else None


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str],  # type: ignore[no-untyped-def]
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for name, doc in COUNTERS.items()
        }
        self._gauges = {
            name: create_metric_per_engine(
                self._gauge_cls(name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames,
                                multiprocess_mode="mostrecent"),
                per_engine_labelvalues)
            for name, doc in GAUGES.items()
        }
        self._hits = self._counter_cls(name="vllm:kvtier_hit_tokens",
                                       documentation="Tokens of the loads planned from kvtier, by the tier they were found in",
                                       labelnames=[*labelnames, "tier"])
        self._hit_children: dict[tuple[int, str], Any] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters:
                if value > 0:
                    self._counters[key][engine_idx].inc(value)
            elif key in self._gauges:
                self._gauges[key][engine_idx].set(value)
            elif key.startswith(HIT_PREFIX) and value > 0:
                tier = key[len(HIT_PREFIX):]
                child = self._hit_children.get((engine_idx, tier))
                if child is None:
                    labels = [*self.per_engine_labelvalues[engine_idx], tier]
                    child = self._hit_children[(engine_idx, tier)] = self._hits.labels(*labels)
                child.inc(value)


__all__ = ["COUNTERS", "GAUGES", "HIT_PREFIX", "Deltas", "KVTierPromMetrics", "KVTierStats"]
