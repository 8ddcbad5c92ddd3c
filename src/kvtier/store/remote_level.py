"""The shared remote tier as the cache sees it: what is known to be there (and under which
tenant it was found or uploaded), asked for outside the cache's lock, and uploads straight from
DRAM.

Lookups ask the remote tier (one round trip, :meth:`RemoteLevel.probe`) for the chunks past the
locally held prefix, except those found there within ``remote_verify_s``; a chunk the server
did not have is not asked for again for ``remote_miss_s``. What a probe finds is indexed at the
remote level; what it no longer finds (another instance evicted it from the shared server)
leaves the index, with every remote-only chunk after it, so the index never promises chunks the
server forgot. At most :data:`MAX_REMOTE_KEYS` remote chunks are remembered (hints only), each
with the tenant it was found or uploaded under (so background work without a request -- a
staging prefetch -- reads it from that tenant's prefix). Which tenant a chunk *written* there
belongs to is never looked up here: the entry being uploaded carries it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.placement import Placement
from kvtier.store.config import make_remote_tier
from kvtier.store.moves import TierMover
from kvtier.tiers.base import Tier
from kvtier.tiers.host import HostTier

MAX_REMOTE_KEYS = 1 << 20
"""Chunks of the remote tier the index remembers at most (hints; a lookup asks again)."""
MAX_ABSENT = 1 << 16


def make_remote(tier_config: object, tenant_of: Callable[[ChunkKey], str]) -> Tier:
    """The remote tier for a backend config: one tier, or one per tenant (Valkey's
    ``tenant_prefixes``, :mod:`kvtier.tiers.tenants`)."""
    if not getattr(tier_config, "tenant_prefixes", False):
        return make_remote_tier(tier_config)
    from kvtier.tiers.tenants import TenantTiers, tenant_prefix

    def make(tenant: str) -> Tier:
        prefix = tenant_prefix(tier_config.prefix, tenant)  # type: ignore[attr-defined]
        return make_remote_tier(dataclasses.replace(tier_config, prefix=prefix, tenant_prefixes=False))  # type: ignore[type-var]

    return TenantTiers(make, tenant_of)


class RemoteLevel:
    """Bookkeeping of the remote tier at ``level`` (its calls go out without ``lock``)."""

    def __init__(self, tier: Tier, level: int, placement: Placement, lock: threading.Lock,
                 verify_s: float, miss_s: float) -> None:
        self.tier = tier
        self.level = level
        self.placement = placement
        self.index = placement.index
        self._lock = lock
        self.verify_s = verify_s
        self.miss_s = miss_s
        self._seen: OrderedDict[ChunkKey, float] = OrderedDict()
        self._tenants: dict[ChunkKey, str] = {}
        """The tenant each chunk in ``_seen`` was found or uploaded under (the same keys)."""
        self._absent: OrderedDict[ChunkKey, float] = OrderedDict()

    def recorded_tenant(self, key: ChunkKey) -> str | None:
        """The tenant a chunk the index knows at this level was found or uploaded under (one
        dict read: safe from any thread); None if it is not known here."""
        return self._tenants.get(key)

    def _seen_now(self, key: ChunkKey, tenant: str, now: float) -> None:
        self._seen[key] = now
        self._seen.move_to_end(key)
        self._tenants[key] = tenant

    # -- what is there ------------------------------------------------------------------------
    def probe(self, keys: Sequence[ChunkKey], tenant: str = "") -> None:
        """Ask the remote tier, in one round trip and without the lock, for the chunks of
        ``keys`` (all ``tenant``'s: the caller routes the call there) past the locally held
        prefix not known there recently; index what it holds, unlist what it no longer has."""
        level, now = self.level, time.monotonic()
        with self._lock:
            index, n = self.index, 0
            while n < len(keys) and (found := index.fastest(keys[n])) is not None and found < level:
                n += 1
            seen = self._seen
            while n < len(keys) and index.holds(keys[n], level) and now - seen.get(keys[n], -1e18) < self.verify_s:
                n += 1
            rest = list(keys[n:])
            if not rest or self._absent.get(rest[0], 0.0) > now:
                return
        got = self.tier.contains_prefix(rest)  # 0 when the server is down
        with self._lock:
            now = time.monotonic()
            for key in rest[:got]:
                self.placement.added(key, level)
                self._seen_now(key, tenant, now)
                self._absent.pop(key, None)
            if got < len(rest):
                gone = rest[got]
                for key in rest[got:]:  # gone (another instance evicted it), or unreachable past it
                    if self.index.holds(key, level) and self.index.fastest(key) == level:
                        self.unlist(key)
                self._mark_absent(gone, now)
            self._trim()

    def probe_each(self, keys: Sequence[ChunkKey], tenant: str = "") -> None:
        """Ask the remote tier, in one round trip and without the lock, for each of ``keys``
        on its own (candidates, not a sequence: the partial chunks an engine may have saved)
        not held locally nor known there recently; index what it holds, unlist what it no
        longer has."""
        level, now = self.level, time.monotonic()
        with self._lock:
            index, seen = self.index, self._seen
            rest = [k for k in keys
                    if (index.fastest(k) is None or index.fastest(k) == level)
                    and not (index.holds(k, level) and now - seen.get(k, -1e18) < self.verify_s)
                    and self._absent.get(k, 0.0) <= now]
        if not rest:
            return
        try:
            found = self.tier.contains_many(rest)
        except Exception:  # noqa: BLE001 - unreachable: nothing learned (a lookup is advice)
            return
        with self._lock:
            now = time.monotonic()
            for key, there in zip(rest, found, strict=True):
                if there:
                    self.placement.added(key, level)
                    self._seen_now(key, tenant, now)
                    self._absent.pop(key, None)
                else:  # (not unlisted: a tier that cannot be reached answers "absent" too)
                    self._mark_absent(key, now)
            self._trim()

    def _mark_absent(self, key: ChunkKey, now: float) -> None:
        """Not asked for again for ``miss_s`` (the oldest past :data:`MAX_ABSENT` forgotten).
        Under the lock."""
        self._absent[key] = now + self.miss_s
        self._absent.move_to_end(key)
        while len(self._absent) > MAX_ABSENT:
            self._absent.popitem(last=False)

    def _trim(self) -> None:
        """Forget the oldest remote chunks past :data:`MAX_REMOTE_KEYS` (hints only: they are
        asked for again). Under the lock."""
        seen, level = self._seen, self.level
        while len(seen) > MAX_REMOTE_KEYS:
            old, _ = seen.popitem(last=False)
            self._tenants.pop(old, None)
            if self.index.holds(old, level):
                self.unlist(old)

    def unlist(self, key: ChunkKey) -> None:
        """Drop ``key`` from the index at this level (not a loss: it is just not known there).
        Under the lock."""
        self.index.discard(key, self.level)
        self.placement.policies[self.level].remove(key)
        self._seen.pop(key, None)
        self._tenants.pop(key, None)

    def forgotten(self, key: ChunkKey) -> None:
        """The placement forgot ``key`` here (damage found on read). Under the lock."""
        self._seen.pop(key, None)
        self._tenants.pop(key, None)

    def uploaded(self, key: ChunkKey, ok: bool, tenant: str = "") -> None:
        """The uploader finished a chunk of ``tenant`` (its thread, no lock held)."""
        if ok:
            with self._lock:
                self.placement.added(key, self.level)
                self._seen_now(key, tenant, time.monotonic())
                self._trim()  # a write-heavy instance whose lookups never reach the remote tier

    def upload_from_dram(self, key: ChunkKey, host: HostTier, mover: TierMover) -> None:
        """Queue a saved chunk for the remote tier straight from its DRAM slot, pinned until the
        upload is over (no copy). Under the lock."""
        if self.index.holds(key, self.level) or not host.pin(key):
            return

        mover.in_flight += 1  # a writer waiting for DRAM room waits for this pin to end

        def unpin() -> None:
            with self._lock:
                host.unpin(key)
                mover.in_flight -= 1
                mover.notify()

        if mover.upload(key, host.view(key), after=unpin, seg=host.segment_of(key), fmt=host.format_of(key),
                        tenant=host.tenant_of(key) or ""):
            self.placement.stats.writes_down[self.level] += 1
        else:
            host.unpin(key)
            mover.in_flight -= 1
