"""Where each request's cached KV came from at the moment it was loaded, and how long it waited.

An engine ends a read lease with what it took of each chunk (tokens), what it already held, the
chunks it could not copy and how long the step waited for its loads (``release``); the daemon
knows the tier each chunk was in when the lease was granted. This log keeps that per request
(the id the engine named in ``acquire``), the most recent :data:`MAX_RECORDS` requests, for
``kvtier bench serve``'s per-step report and for anyone asking the daemon (op ``request_loads``):
a request served from DRAM shows ``{"host": n}``, one whose history went down to SSD
``{"disk": n}``, and what vLLM held itself, in its own pool, is ``had``. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["MAX_RECORDS", "RequestLoad", "RequestLoads"]

MAX_RECORDS = 65536
"""Requests remembered (the oldest forgotten first)."""


@dataclass(slots=True)
class RequestLoad:
    tokens: Counter[str] = field(default_factory=Counter)
    """Tier -> tokens the engine took from it."""
    had: int = 0
    """Tokens of loaded chunks the engine already held itself."""
    failed: int = 0
    """Chunks it could not copy (recomputed)."""
    wait_s: float = 0.0
    """Seconds its loads held its steps (summed over its leases' reports)."""
    leases: int = 0
    tenant: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"tokens": dict(self.tokens), "had": self.had, "failed": self.failed,
                "wait_s": round(self.wait_s, 6), "leases": self.leases, "tenant": self.tenant}


class RequestLoads:
    def __init__(self, limit: int = MAX_RECORDS) -> None:
        self._records: OrderedDict[str, RequestLoad] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def record(self, request: str, took: Iterable[tuple[str, int]], *, had: int = 0, failed: int = 0,
               wait_s: float = 0.0, tenant: str = "") -> None:
        with self._lock:
            self._record(request, took, had, failed, wait_s, tenant)

    def _record(self, request: str, took: Iterable[tuple[str, int]], had: int, failed: int, wait_s: float,
                tenant: str) -> None:
        rec = self._records.get(request)
        if rec is None:
            rec = self._records[request] = RequestLoad(tenant=tenant)
            while len(self._records) > self._limit:
                self._records.popitem(last=False)
        for tier, tokens in took:
            if tokens:
                rec.tokens[tier] += tokens
        rec.had += had
        rec.failed += failed
        rec.wait_s += wait_s
        rec.leases += 1

    def matching(self, part: str, limit: int = 1024, visible: Callable[[str], bool] = lambda _t: True
                 ) -> list[dict[str, object]]:
        """The records (each with its ``request`` id) of the ids that contain ``part`` and whose
        tenant is ``visible``, the latest ``limit``, newest first (a list: the protocol's maps
        are small)."""
        out: list[dict[str, object]] = []
        with self._lock:
            for request in reversed(self._records):
                if part in request and visible(self._records[request].tenant):
                    out.append({"request": request, **self._records[request].as_dict()})
                    if len(out) >= limit:
                        break
        return out
