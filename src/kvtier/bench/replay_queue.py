"""The queue of a trace replay (:mod:`kvtier.bench.replay`): requests in service order as they
arrive, in an open loop (the trace's arrivals) or a closed one (a session's next turn after
its reply), and each request's next turn in its session."""

from __future__ import annotations

import heapq

from kvtier.bench.trace import Request


class _Queue:
    """The requests in service order (first come, first served), as they arrive.

    Open loop: the trace's own order and arrival times. Closed loop: a session's first turn
    arrives at its ``arrival_s``, each later one its ``think_s`` (without one: the gap between
    the two turns' ``arrival_s``) after the previous turn's reply is done (:meth:`reply_done`),
    so requests get their numbers as they arrive.
    """

    def __init__(self, requests: list[Request], closed: bool) -> None:
        self._closed = closed
        if not closed:
            self._order = list(range(len(requests)))
            self._arrival = [r.arrival_s for r in requests]
            return
        for req in requests:
            if req.session_id is None:
                raise ValueError("a closed-loop replay needs a trace that names sessions")
        self._think: list[float] = [0.0] * len(requests)
        last: dict[object, float] = {}
        self._pending: list[tuple[float, int]] = []
        for i, req in enumerate(requests):
            if req.session_id not in last:
                self._pending.append((req.arrival_s, i))
            else:  # without a think time of its own: the trace's gap between the two turns
                self._think[i] = req.think_s if req.think_s is not None else \
                    max(0.0, req.arrival_s - last[req.session_id])
            last[req.session_id] = req.arrival_s
        heapq.heapify(self._pending)
        self._order = []
        self._arrival = []

    def __len__(self) -> int:
        """Requests arrived (numbered) so far."""
        return len(self._order)

    def index(self, seq: int) -> int:
        return self._order[seq]

    def arrival(self, seq: int) -> float:
        return self._arrival[seq]

    def _arrive(self) -> None:
        at, index = heapq.heappop(self._pending)
        self._order.append(index)
        self._arrival.append(at)

    def serve(self, seq: int) -> tuple[int, float]:
        """(trace index, arrival) of request number ``seq``, the next to be served."""
        while len(self._order) <= seq:
            if not self._closed or not self._pending:
                raise ValueError("a closed loop ran out of requests: a session's later turn never arrived")
            self._arrive()
        return self._order[seq], self._arrival[seq]

    def arrive_by(self, now: float) -> None:
        """Number every request that has arrived by ``now``."""
        if self._closed:
            while self._pending and self._pending[0][0] <= now:
                self._arrive()

    def reply_done(self, index: int, at: float) -> None:
        """Request ``index``'s previous turn has its reply at ``at``: closed loop, it arrives
        after its think time."""
        if self._closed:
            heapq.heappush(self._pending, (at + self._think[index], index))

    def served(self) -> list[tuple[int, float]]:
        return list(zip(self._order, self._arrival, strict=True))


def _next_in_session(requests: list) -> list[int | None]:
    """For each request, the number of its session's next request (None: the last, or a trace
    without session ids)."""
    following: list[int | None] = [None] * len(requests)
    last: dict[object, int] = {}
    for seq, req in enumerate(requests):
        sid = req.session_id
        if sid is None:
            continue
        if sid in last:
            following[last[sid]] = seq
        last[sid] = seq
    return following
