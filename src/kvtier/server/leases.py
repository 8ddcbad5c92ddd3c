"""Leases: what a daemon client holds -- DRAM pins to read, DRAM reservations to write -- by name.

A client names each lease it asks for (its own random client id and a lease number), so that it
can refer to one even if the reply that granted it never arrived. A lease lives on the client's
connection: every operation on it (``release``, ``commit``) must come on that connection, and
one that names a lease the daemon has ended is refused (the client treats the lease as lost).

Every lease has a time to live (``lease_ttl_s``), on a live connection too: a holder that never
ends a read lease cannot pin DRAM for good. A write lease's slots stay reserved while its
holder lives and has not ended it (below): a client that may use the daemon can hold DRAM that
way (up to the arena), as it could by saving; confine uids with ``[access.tenants]``.

- a **read lease** past its TTL is ended at once: its pins are released and its slots may be
  reused. Its holder's ``release`` is then refused (lost), and a client trusts what it read
  only if its ``release`` is acknowledged, so nothing it copied after that is used;
- a **write lease** past its TTL is *fenced*: it can no longer be committed, but its slots stay
  reserved -- its holder may still be writing them -- until the holder says it has stopped (its
  ``commit`` or ``abandon``, which is refused as lost and frees the slots) or its connection
  ends (then the lease is orphaned, below). A late write can only ever land in a slot that is
  still reserved for the lease that wrote it, never in another chunk's.

When a connection ends with leases open -- the client exited, crashed, or gave up on a call and
dropped the connection -- the daemon ends them:

- a **read lease**'s pins are released at once (as above: a client still copying out of them
  never trusts what it copies);
- a **write lease**'s reservations are *orphaned*, not freed: the client may still be writing
  into those slots, and a slot handed to another chunk would then receive this one's bytes. An
  orphaned slot is freed only when nothing can still touch it: the client says so (``forget``,
  sent once its caller has ended the lease, on a later connection) or its process has exited
  (a pidfd, immune to pid reuse). Never after a timeout: an orphan whose client neither says so
  nor exits stays *quarantined* (its slots unused, counted in the stats; a warning once it is
  older than ``report_after_s``) -- a leak of that lease's slots, never a late write into
  another chunk. A client that cannot be watched (its pid is not visible from the daemon's pid
  namespace) keeps its orphans until it says so or the daemon restarts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.core.keys import ChunkKey
from kvtier.errors import KVTierError
from kvtier.server.runtime import ProcessWatch
from kvtier.store.cache import ChunkCache
from kvtier.tiers.base import Reservation

log = logging.getLogger(__name__)

MAX_FORGOTTEN = 1 << 16
FORGOTTEN_S = 600.0
"""How long a ``forget`` that arrived before the end of its lease's connection is remembered."""


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
    request: str | None = None
    """Read lease: the request it loads for, as the cache names it (its load is logged under it)."""
    tenant: str = ""
    """Read lease: the tenant its keys are bound to."""
    writes: dict[int, Reservation] = field(default_factory=dict)
    """Write lease: index in ``keys`` -> its DRAM reservation."""
    expires: float = math.inf
    """``time.monotonic()`` past which the daemon ends (reads) or fences (writes) it."""
    fenced: bool = False
    """A write lease past its TTL: refused at commit; its slots reserved until then."""


Owner = tuple[int, int]
"""Who held a lease: the (pid, uid) at the other end of its connection (pid 0: not visible)."""


@dataclass(slots=True)
class _Orphan:
    lease: Lease
    watch: ProcessWatch
    since: float
    reported: bool = False


class Leases:
    """Every lease the daemon has granted (each connection's, in a dict the connection's
    session owns but only this object changes, under its lock) and the orphaned write leases."""

    def __init__(self, cache: ChunkCache, ttl_s: float, report_after_s: float) -> None:
        self.cache = cache
        self.ttl_s = ttl_s
        self.report_after_s = report_after_s
        self._lock = threading.Lock()
        self._orphans: dict[tuple[bytes, int, Owner], list[_Orphan]] = {}
        """By (client id, lease id, owner): a list, since nothing stops a client from naming a
        lease id again after its connection ended (each orphan is kept, none overwritten)."""
        self._forgotten: dict[tuple[bytes, int, Owner], float] = {}
        """Leases a client said it ended before their connection's end reached the daemon (a
        thread still busy on the old connection): freed at once when it does."""
        self.orphans_freed = 0
        self.expired_reads = 0
        """Read leases ended by their TTL (their holder never released them in time)."""
        self.fenced_writes = 0
        """Write leases fenced by their TTL."""

    # -- on a connection ----------------------------------------------------------------------
    def holds(self, held: dict[int, Lease], lease_id: int) -> bool:
        with self._lock:
            return lease_id in held

    def grant(self, held: dict[int, Lease], lease: Lease) -> None:
        lease.expires = time.monotonic() + self.ttl_s
        with self._lock:
            if lease.id in held:
                raise ValueError(f"lease {lease.id} is already held on this connection")
            held[lease.id] = lease

    def take(self, held: dict[int, Lease], lease_id: int, write: bool) -> Lease:
        """End lease ``lease_id`` of this connection and return it. LeaseEnded if it is not
        held (ended, expired, never granted) -- and for a fenced write lease, whose slots are
        freed now: its holder, committing, has stopped writing them."""
        with self._lock:
            lease = held.get(lease_id)
            if lease is None or lease.write != write:
                raise LeaseEnded(f"lease {lease_id} is not held on this connection (ended, expired, "
                                 "or never granted)")
            del held[lease_id]
        if lease.fenced:
            self._abandon(lease)
            raise LeaseEnded(f"lease {lease_id} expired after {self.ttl_s:g} s; nothing of it is stored")
        return lease

    def end(self, held: dict[int, Lease], watch: ProcessWatch, owner: Owner = (0, -1)) -> tuple[int, int]:
        """The connection (of ``owner``) is gone: release its read leases, orphan its write
        leases. Returns (pins released, reservations orphaned)."""
        pins = orphaned = 0
        now = time.monotonic()
        freed: list[Lease] = []
        with self._lock:
            leases = list(held.values())
            held.clear()
            for lease in leases:
                if not lease.write:
                    pins += len(lease.keys)
                elif lease.writes:
                    if self._forgotten.pop((lease.client, lease.id, owner), None) is not None:
                        freed.append(lease)  # the client already said it stopped writing them
                    else:
                        self._orphans.setdefault((lease.client, lease.id, owner), []).append(
                            _Orphan(lease, watch, now))
                        orphaned += len(lease.writes)
        for lease in leases:
            if not lease.write:
                self.cache.release(lease.keys)
        for lease in freed:
            self._abandon(lease)
            self.orphans_freed += 1
        if not orphaned:
            watch.close()
        return pins, orphaned

    # -- time ---------------------------------------------------------------------------------
    def expire(self, sessions: Iterable[dict[int, Lease]]) -> None:
        """End the read leases and fence the write leases past their TTL."""
        now = time.monotonic()
        ended: list[Lease] = []
        with self._lock:
            for held in sessions:
                for lease in [x for x in held.values() if x.expires <= now and not x.fenced]:
                    if lease.write:
                        lease.fenced = True
                        self.fenced_writes += 1
                        log.warning("write lease %d outlived its %g s TTL: fenced (its %d DRAM slots stay "
                                    "reserved until its holder ends it)", lease.id, self.ttl_s, len(lease.writes))
                    else:
                        del held[lease.id]
                        ended.append(lease)
                        self.expired_reads += 1
        for lease in ended:
            log.warning("read lease %d outlived its %g s TTL: its %d pins are released", lease.id,
                        self.ttl_s, len(lease.keys))
            self.cache.release(lease.keys)

    # -- orphans ------------------------------------------------------------------------------
    def forget(self, client: bytes, ids: Iterable[int], owner: Owner = (0, -1)) -> int:
        """The client has ended these leases (its caller no longer touches their views): free
        their slots. Only the process that held a lease may say so (``owner``: the same pid and
        uid as the lease's connection): a client id is the client's own choice, so another
        process naming it frees nothing. Returns how many reservations were freed."""
        freed = 0
        now = time.monotonic()
        for lease_id in ids:
            with self._lock:
                orphans = self._orphans.pop((client, lease_id, owner), None)
                if orphans is None:  # its connection's end may not have reached us yet
                    self._forgotten[(client, lease_id, owner)] = now + FORGOTTEN_S
                    while len(self._forgotten) > MAX_FORGOTTEN:
                        self._forgotten.pop(next(iter(self._forgotten)))
            for orphan in orphans or ():
                freed += self._free(orphan)
                self.orphans_freed += 1
        return freed

    def reap(self) -> None:
        """Free the orphans whose client process exited; report those quarantined long."""
        now = time.monotonic()
        with self._lock:
            exited: dict[int, bool] = {}
            for o in self._all():
                if id(o.watch) not in exited:
                    try:
                        exited[id(o.watch)] = o.watch.exited()
                    except (OSError, ValueError):  # one bad watch must not stop the others' reaping
                        log.exception("watching a client process failed")
                        exited[id(o.watch)] = False
            done = []
            for k in list(self._orphans):
                keep = [o for o in self._orphans[k] if not exited[id(o.watch)]]
                done += [o for o in self._orphans[k] if exited[id(o.watch)]]
                if keep:
                    self._orphans[k] = keep
                else:
                    del self._orphans[k]
            late = [o for o in self._all() if not o.reported and now - o.since >= self.report_after_s]
            for o in late:
                o.reported = True
            for k in [k for k, t in self._forgotten.items() if t <= now]:
                del self._forgotten[k]
        for o in late:
            log.warning("%d DRAM slots of lease %d stay quarantined: their client (%s) neither said it "
                        "stopped writing them nor exited in %.0f s", len(o.lease.writes), o.lease.id,
                        "watched" if o.watch.known else "its process cannot be watched", now - o.since)
        for orphan in done:
            self.orphans_freed += 1
            self._free(orphan)

    def _abandon(self, lease: Lease) -> int:
        for res in lease.writes.values():
            self.cache.commit(res, ok=False)
        n = len(lease.writes)
        lease.writes.clear()
        return n

    def _free(self, orphan: _Orphan) -> int:
        n = self._abandon(orphan.lease)
        with self._lock:
            still = any(o.watch is orphan.watch for o in self._all())
        if not still:
            orphan.watch.close()
        return n

    def orphaned(self) -> int:
        """DRAM reservations held by orphaned leases now."""
        with self._lock:
            return sum(len(o.lease.writes) for o in self._all())

    def _all(self) -> list[_Orphan]:
        """Every orphan (under the lock)."""
        return [o for group in self._orphans.values() for o in group]

    def quarantined(self) -> int:
        """DRAM reservations of orphans older than ``report_after_s`` (reported as leaked)."""
        now = time.monotonic()
        with self._lock:
            return sum(len(o.lease.writes) for o in self._all() if now - o.since >= self.report_after_s)

    def counts(self, sessions: Iterable[dict[int, Lease]]) -> tuple[int, int]:
        """(DRAM pins held by read leases, DRAM reservations held by write leases) now."""
        with self._lock:
            leases = [x for held in sessions for x in held.values()]
            return (sum(len(x.keys) for x in leases if not x.write),
                    sum(len(x.writes) for x in leases if x.write))

    def close(self) -> None:
        with self._lock:
            orphans = self._all()
            self._orphans.clear()
        for orphan in orphans:
            self._free(orphan)
