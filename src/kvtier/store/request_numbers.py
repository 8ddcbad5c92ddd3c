"""Request numbers: the policies' notion of a use.

Every request an engine serves gets a number in arrival order: when it is announced
(``queued``, for the look-ahead policies) or, if it never was, when it starts. Its lookups,
loads and saves carry that number as their ``use``, so the policies count one use of a chunk
per request however its calls interleave with other requests'. Not thread-safe: the cache
calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_REQUESTS = 65536
"""Requests remembered while queued, while running, and once finished, at most (the oldest
are forgotten: a request announced and never started was aborted)."""


def _remember(requests: OrderedDict[str, int], request_id: str, seq: int) -> None:
    """``requests[request_id] = seq``, the oldest forgotten past ``MAX_REQUESTS``."""
    requests[request_id] = seq
    while len(requests) > MAX_REQUESTS:
        requests.popitem(last=False)


class Requests:
    def __init__(self) -> None:
        self._next = 0
        self._waiting: OrderedDict[str, int] = OrderedDict()
        self._running: OrderedDict[str, int] = OrderedDict()
        self._finished: OrderedDict[str, int] = OrderedDict()
        """Requests finished lately: an engine may save a request's last chunks (its reply)
        after saying it finished (vLLM's scheduler does), and those saves are still its use
        (``use_of(..., finished=True)``)."""

    def _new(self) -> int:
        seq = self._next
        self._next += 1
        return seq

    def queued(self, request_id: str) -> int:
        """The number of a request that arrived (the same one if it was announced before)."""
        seq = self._waiting.get(request_id)
        if seq is None:
            self._finished.pop(request_id, None)  # the same name again: a new request
            seq = self._new()
            _remember(self._waiting, request_id, seq)
        return seq

    def started(self, request_id: str) -> tuple[int, bool]:
        """The number of a request being served, and whether it starts now (False when it was
        started before: a scheduler asks again while it waits)."""
        seq = self._waiting.pop(request_id, None)
        if seq is None:
            seq = self._running.get(request_id)
            if seq is not None:
                return seq, False
            seq = self._new()
        self._finished.pop(request_id, None)  # the same name again: a new request
        _remember(self._running, request_id, seq)
        return seq, True

    def use_of(self, request_id: str | None, *, finished: bool = False) -> int | None:
        """A queued or running request's number; with ``finished`` also a finished one's (for
        the saves of its last chunks: a lookup under a name that finished is a new request's,
        announced late, as after an engine's restart)."""
        if request_id is None:
            return None
        seq = self._running.get(request_id)
        if seq is None:
            seq = self._waiting.get(request_id)
        return seq if seq is not None or not finished else self._finished.get(request_id)

    def finished(self, request_id: str) -> int | None:
        """A request is done (or, never started, aborted while it waited); its number (None:
        unknown, forgotten, or finished before), so that whoever heard of it when it was queued
        hears of its end. Its number still names its saves for a while (``MAX_REQUESTS``)."""
        seq = self._running.pop(request_id, None)
        if seq is None:
            seq = self._waiting.pop(request_id, None)
        else:
            self._waiting.pop(request_id, None)
        if seq is not None:
            _remember(self._finished, request_id, seq)
        return seq
