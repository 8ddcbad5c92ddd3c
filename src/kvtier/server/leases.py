"""Leases: what a daemon client holds -- DRAM pins to read, DRAM reservations to write -- by name.

A client names each lease it asks for (its own random client id and a lease number), so that it
can refer to one even if the reply that granted it never arrived. A lease lives on the client's
connection: every operation on it (``release``, ``commit``) must come on that connection, and
one that names a lease the daemon has ended is refused (the client treats the lease as lost).

When a connection ends with leases open -- the client exited, crashed, or gave up on a call and
dropped the connection -- the daemon ends them:

- a **read lease**'s pins are released at once. Its slots may be reused, and a client still
  copying out of them may copy another chunk's bytes: that is why a client trusts what it read
  only if its ``release`` is acknowledged (the lease was intact the whole time);
- a **write lease**'s reservations are *orphaned*, not freed: the client may still be writing
  into those slots, and a slot handed to another chunk would then receive this one's bytes. An
  orphaned slot is freed only when nothing can still touch it: the client says so (``forget``,
  sent once its caller has ended the lease, on a later connection), its process has exited
  (a pidfd, immune to pid reuse), or ``orphan_grace_s`` has passed (a warning is logged).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.cache import ChunkCache
from kvtier.core.keys import ChunkKey
from kvtier.errors import KVTierError
from kvtier.server.runtime import ProcessWatch
from kvtier.tiers.base import Reservation

log = logging.getLogger(__name__)

MAX_FORGOTTEN = 1 << 16


class LeaseEnded(KVTierError):
    """The lease named is not (or no longer) held on this connection."""


@dataclass(slots=True)
class Lease:
    id: int
    client: bytes
    write: bool
    keys: list[ChunkKey]
    """Store keys, in the order of the request (chunks ``first``, ``first + 1``...)."""
    first: int
    use: int | None
    sources: list[str] = field(default_factory=list)
    """Read lease: the tier each chunk was found in."""
    writes: dict[int, Reservation] = field(default_factory=dict)
    """Write lease: index in ``keys`` -> its DRAM reservation."""


@dataclass(slots=True)
class _Orphan:
    lease: Lease
    watch: ProcessWatch
    deadline: float


class Leases:
    """Every lease the daemon has granted, and the orphaned write leases."""

    def __init__(self, cache: ChunkCache, orphan_grace_s: float) -> None:
        self.cache = cache
        self.grace_s = orphan_grace_s
        self._lock = threading.Lock()
        self._orphans: dict[tuple[bytes, int], _Orphan] = {}
        self._forgotten: dict[tuple[bytes, int], float] = {}
        """Leases a client said it ended before their connection's end reached the daemon (a
        thread still busy on the old connection): freed at once when it does."""
        self.orphans_freed = 0
        self.orphans_expired = 0

    # -- on a connection ----------------------------------------------------------------------
    @staticmethod
    def grant(held: dict[int, Lease], lease: Lease) -> None:
        if lease.id in held:
            raise ValueError(f"lease {lease.id} is already held on this connection")
        held[lease.id] = lease

    @staticmethod
    def take(held: dict[int, Lease], lease_id: int, write: bool) -> Lease:
        lease = held.get(lease_id)
        if lease is None or lease.write != write:
            raise LeaseEnded(f"lease {lease_id} is not held on this connection (ended, or never granted)")
        del held[lease_id]
        return lease

    def end(self, held: dict[int, Lease], watch: ProcessWatch) -> tuple[int, int]:
        """The connection is gone: release its read leases, orphan its write leases. Returns
        (pins released, reservations orphaned)."""
        pins = orphaned = 0
        now = time.monotonic()
        for lease in held.values():
            if not lease.write:
                self.cache.release(lease.keys)
                pins += len(lease.keys)
            elif lease.writes:
                with self._lock:
                    told = self._forgotten.pop((lease.client, lease.id), None) is not None
                    if not told:
                        self._orphans[(lease.client, lease.id)] = _Orphan(lease, watch, now + self.grace_s)
                if told:  # the client already said it stopped writing these slots
                    for res in lease.writes.values():
                        self.cache.commit(res, ok=False)
                    lease.writes.clear()
                    self.orphans_freed += 1
                else:
                    orphaned += len(lease.writes)
        held.clear()
        if not orphaned:
            watch.close()
        return pins, orphaned

    # -- orphans ------------------------------------------------------------------------------
    def forget(self, client: bytes, ids: Iterable[int]) -> int:
        """The client has ended these leases (its caller no longer touches their views): free
        their slots. Returns how many reservations were freed."""
        freed = 0
        now = time.monotonic()
        for lease_id in ids:
            with self._lock:
                orphan = self._orphans.pop((client, lease_id), None)
                if orphan is None:  # its connection's end may not have reached us yet
                    self._forgotten[(client, lease_id)] = now + self.grace_s
                    while len(self._forgotten) > MAX_FORGOTTEN:
                        self._forgotten.pop(next(iter(self._forgotten)))
            if orphan is not None:
                freed += self._free(orphan)
                self.orphans_freed += 1
        return freed

    def reap(self) -> None:
        """Free the orphans whose client process exited or whose grace period is over."""
        now = time.monotonic()
        with self._lock:
            exited = {id(o.watch): o.watch.exited() for o in self._orphans.values()}
            done = [(k, o) for k, o in self._orphans.items() if exited[id(o.watch)] or now >= o.deadline]
            for k, _ in done:
                del self._orphans[k]
            for k in [k for k, t in self._forgotten.items() if t <= now]:
                del self._forgotten[k]
        for _, orphan in done:
            if not exited[id(orphan.watch)]:
                log.warning("freeing %d DRAM slots of lease %d after %.0f s: its client never said "
                            "it stopped writing them", len(orphan.lease.writes), orphan.lease.id, self.grace_s)
                self.orphans_expired += 1
            else:
                self.orphans_freed += 1
            self._free(orphan)

    def _free(self, orphan: _Orphan) -> int:
        for res in orphan.lease.writes.values():
            self.cache.commit(res, ok=False)
        n = len(orphan.lease.writes)
        orphan.lease.writes.clear()
        with self._lock:
            still = any(o.watch is orphan.watch for o in self._orphans.values())
        if not still:
            orphan.watch.close()
        return n

    def orphaned(self) -> int:
        """DRAM reservations held by orphaned leases now."""
        with self._lock:
            return sum(len(o.lease.writes) for o in self._orphans.values())

    def close(self) -> None:
        with self._lock:
            orphans = list(self._orphans.values())
            self._orphans.clear()
        for orphan in orphans:
            self._free(orphan)
