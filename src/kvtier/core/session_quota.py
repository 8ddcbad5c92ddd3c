"""How much of the store retained sessions hold: the quota a session hint's retention is checked
against (:class:`~kvtier.core.sessions.SessionBook` keeps it).

Counted in bytes of chunks, each distinct chunk once per tenant however many of the tenant's
retained sessions hold it (a shared system prompt counts once), against the store's local
capacity (DRAM + SSD). With chunks of one size that is the capacity in chunks; with several
models' chunks each weighs what it takes. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.core.keys import ChunkKey

GLOBAL_SHARE = 0.9
"""All tenants' retained chunks together hold at most this share of the local capacity."""


class TenantQuota:
    """Retained bytes per tenant and in all, against ``share`` (per tenant) and
    :data:`GLOBAL_SHARE` (all tenants) of ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, share: float) -> None:
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

    def fits(self, tenant: str, keys: Iterable[ChunkKey], weight: int) -> bool:
        """Whether retaining ``keys`` (``weight`` bytes each) keeps ``tenant`` within its share
        and all tenants within theirs. Never with a share of 0 (retention disabled)."""
        if self.share <= 0:
            return False
        held = self._keys.get(tenant, {})
        extra = weight * len({k for k in keys if k not in held})
        return (self._bytes.get(tenant, 0) + extra <= self.share * self.capacity_bytes
                and self.total_bytes + extra <= GLOBAL_SHARE * self.capacity_bytes)

    def add(self, tenant: str, keys: Iterable[ChunkKey], weight: int) -> None:
        held = self._keys.setdefault(tenant, {})
        for key in keys:
            n = held.get(key, 0)
            held[key] = n + 1
            if not n:
                self._bytes[tenant] = self._bytes.get(tenant, 0) + weight
                self.total_bytes += weight

    def remove(self, tenant: str, keys: Iterable[ChunkKey], weight: int) -> None:
        held = self._keys.get(tenant)
        if held is None:
            return
        for key in keys:
            n = held.get(key, 0)
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
