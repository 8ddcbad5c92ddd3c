"""How much of the store retained sessions hold: the quota a session hint's retention is checked
against (:class:`~kvtier.core.sessions.SessionBook` keeps it).

Counted in bytes of chunks, each distinct chunk once per tenant however many of the tenant's
retained sessions hold it (a shared system prompt counts once), against the store's local
capacity (DRAM + SSD). With chunks of one size that is the capacity in chunks; with several
models' chunks each weighs what it takes. It also answers, in one read, whether any retained
session holds a chunk (:meth:`TenantQuota.retains`). Not thread-safe: the store calls it under its
lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier.core.keys import ChunkKey

GLOBAL_SHARE = 0.9
"""All tenants' retained chunks together hold at most this share of the local capacity."""


class TenantQuota:
    """Retained bytes per tenant and in all, against ``share`` (per tenant) and
    :data:`GLOBAL_SHARE` (all tenants) of ``capacity_bytes``; ``changed(key, +1 or -1)`` is told
    when a chunk becomes retained (by any session) and when it is no longer."""

    def __init__(self, capacity_bytes: int, share: float,
                 changed: Callable[[ChunkKey, int], None] | None = None) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"hint_share must be a number from 0 to 1, got {share!r}")
        self.capacity_bytes = capacity_bytes
        self.share = float(share)
        self.total_bytes = 0
        self._keys: dict[str, dict[ChunkKey, int]] = {}
        """tenant -> chunk -> how many of its retained sessions hold it."""
        self._bytes: dict[str, int] = {}
        self._all: dict[ChunkKey, int] = {}
        """chunk -> how many retained sessions hold it, all tenants'."""
        self._changed = changed

    def fits(self, tenant: str, keys: Iterable[ChunkKey], weight: int) -> bool:
        """Whether retaining ``keys`` (``weight`` bytes each) keeps ``tenant`` within its share
        and all tenants within theirs. Never with a share of 0 (retention disabled)."""
        if self.share <= 0:
            return False
        held = self._keys.get(tenant, {})
        extra = weight * len({k for k in keys if k not in held})
        return (self._bytes.get(tenant, 0) + extra <= self.share * self.capacity_bytes
                and self.total_bytes + extra <= GLOBAL_SHARE * self.capacity_bytes)

    def retains(self, key: ChunkKey) -> bool:
        """Whether a retained session (of any tenant) holds ``key``."""
        return key in self._all

    def add(self, tenant: str, keys: Iterable[ChunkKey], weight: int) -> None:
        """A retained session of ``tenant`` holds ``keys`` (each once) from now."""
        held = self._keys.setdefault(tenant, {})
        every = self._all
        for key in keys:
            m = every.get(key, 0)
            every[key] = m + 1
            if not m and self._changed is not None:
                self._changed(key, 1)
            n = held.get(key, 0)
            held[key] = n + 1
            if not n:
                self._bytes[tenant] = self._bytes.get(tenant, 0) + weight
                self.total_bytes += weight

    def remove(self, tenant: str, keys: Iterable[ChunkKey], weight: int) -> None:
        """A retained session of ``tenant`` holds ``keys`` no more (each of them it held)."""
        held = self._keys.get(tenant)
        if held is None:
            return
        every = self._all
        for key in keys:
            n = held.get(key, 0)
            if n:
                m = every[key] - 1
                if m:
                    every[key] = m
                else:
                    del every[key]
                    if self._changed is not None:
                        self._changed(key, -1)
            if n > 1:
                held[key] = n - 1
            elif n == 1:
                del held[key]
                self._bytes[tenant] -= weight
                self.total_bytes -= weight
        if not held:
            del self._keys[tenant]
            self._bytes.pop(tenant, None)

    def held_bytes(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)
