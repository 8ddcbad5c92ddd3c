"""Up/down state of a remote tier's connection (:class:`Health`): fail fast while the server
is down, try again every ``reconnect_interval_s``, log an outage once."""

from __future__ import annotations

import logging
import threading
import time

from kvtier.tiers.base import TierStats

log = logging.getLogger(__name__)


class Health:
    """Up/down state of one remote connection.

    After a failure the tier is down: calls fail fast (a miss, False) without touching the
    network until ``reconnect_interval_s`` has passed; then the next call tries the server again.
    Each failure is counted in ``stats.errors``; a warning is logged when the tier goes down and
    an info line when it comes back, so an outage logs two lines, not one per call.
    """

    def __init__(self, name: str, reconnect_interval_s: float, stats: TierStats) -> None:
        self.name = name
        self._interval = reconnect_interval_s
        self._stats = stats
        self._up = True
        self._retry_at = 0.0
        self._refused_at = -1e9
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self._up

    def ready(self) -> bool:
        """Whether a call may go to the server now."""
        return self._up or time.monotonic() >= self._retry_at

    def failed(self, what: str, exc: object) -> None:
        with self._lock:
            self._stats.errors += 1
            was_up, self._up = self._up, False
            self._retry_at = time.monotonic() + self._interval
        if was_up:
            log.warning("%s: %s failed, tier down (retrying every %.1fs): %s",
                        self.name, what, self._interval, exc)
        else:
            log.debug("%s: %s failed again: %s", self.name, what, exc)

    def refused(self, what: str, exc: object) -> None:
        """The server answered this call with an error (out of memory, say): counted, logged at
        most once per ``reconnect_interval_s`` (at least 5 s); the tier stays up."""
        self._stats.errors += 1
        now = time.monotonic()
        if now - self._refused_at >= max(self._interval, 5.0):
            self._refused_at = now
            log.warning("%s: %s failed: %s", self.name, what, exc)
        else:
            log.debug("%s: %s failed: %s", self.name, what, exc)

    def succeeded(self) -> None:
        if not self._up:
            with self._lock:
                was_up, self._up = self._up, True
            if not was_up:
                log.info("%s: server reachable again, tier up", self.name)
