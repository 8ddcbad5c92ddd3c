"""The lease-level client of the store daemon: :class:`LeaseClient` (which
:class:`~kvtier.server.client.StoreClient` extends with the store API), and the leases it hands
out, for engines that copy their own pages.

Leases. ``acquire`` returns a :class:`ReadLease` (views of pinned DRAM slots), ``reserve`` a
:class:`WriteLease` (views of reserved slots). **A view is valid from the call that returned it
until the lease's ``release`` / ``commit`` / ``abandon``, and only if that call succeeds**:

- ``release`` returns True only if the daemon confirms the lease was intact the whole time; if it
  returns False (the lease was lost: the connection broke or timed out, the daemon restarted),
  anything read through its views must be thrown away -- the slots may have been reused.
- ``commit`` returns the number of chunks stored; on a lost lease nothing is stored.

A lease-bearing call is never sent again on a new connection behind the caller's back: a
connection that breaks loses its leases, the caller is told, and the slots of a lost write
lease are freed by the daemon only once this client says (``forget``, after the caller ended
the lease) that nothing here writes them any more, or once this process is gone. The arena of
a daemon that went away stays mapped here until the last lease on it is ended, so a view never
points at unmapped memory.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.core.keys import ChunkKey, Namespace, chunk_tokens_of
from kvtier.core.layout import KVLayout
from kvtier.errors import DaemonUnavailable, LeaseLost
from kvtier.server import protocol
from kvtier.server.connection import Connection, Link
from kvtier.server.runtime import default_socket_path

log = logging.getLogger(__name__)

HELD, BUSY = -1, -2
MAX_BUDGET_MS = 60_000


@dataclass(eq=False)
class ReadLease:
    """DRAM pins on the longest held prefix of the keys asked for: ``views[i]`` holds chunk
    ``keys[i]``'s bytes (see the module docstring for how long)."""

    id: int
    keys: list[ChunkKey]
    views: list[torch.Tensor]
    tiers: list[str]
    """Where each chunk was found (``host``, or the tier it was promoted from)."""
    _conn: Connection = field(repr=False)
    ended: bool = False


@dataclass(eq=False)
class WriteLease:
    """DRAM slots to write new chunks into: ``views[i]`` for ``keys[i]``, None where there is
    nothing to write (``held[i]``: already stored; else being written by someone else now)."""

    id: int | None
    keys: list[ChunkKey]
    views: list[torch.Tensor | None]
    held: list[bool]
    _conn: Connection | None = field(repr=False)
    ended: bool = False


class LeaseClient:
    """The daemon's lease-level calls, and the connection they go over. Thread-safe; one
    connection at a time, requests serialized."""

    def __init__(self, socket_path: str | None = None, *, model: str | None = None,
                 layout: KVLayout | None = None, tenant: str | None = None, page_format: str = "",
                 timeout_s: float = 5.0, retry_s: float = 1.0, instance: str | None = None,
                 daemon_uid: int | None = None, map_arena: bool = True,
                 budget_s: float | None = None) -> None:
        if (model is None) != (layout is None):
            raise ValueError("StoreClient needs both model and layout (a namespace), or neither")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("StoreClient model must be a non-empty string (the weights' fingerprint)")
        self.socket_path = socket_path or default_socket_path()
        self.model = model
        self.layout = layout
        self.tenant = tenant
        self.page_format = page_format
        self.instance = instance
        """Names this client's requests together with other processes' (a vLLM instance's
        scheduler and workers share one); default: its process."""
        self.errors = 0
        """Requests that failed because the daemon was unreachable or answered an error."""
        self.lost_leases = 0
        """Leases that ended before their holder ended them (what they read was thrown away)."""
        if daemon_uid is not None and (not isinstance(daemon_uid, int) or isinstance(daemon_uid, bool)
                                       or daemon_uid < 0):
            raise ValueError(f"StoreClient daemon_uid must be a user id, got {daemon_uid!r}")
        if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float))
                                     or not 0 < budget_s <= MAX_BUDGET_MS / 1000):
            raise ValueError(f"StoreClient budget_s must be seconds in (0, {MAX_BUDGET_MS / 1000:g}], got {budget_s!r}")
        self.budget_s = budget_s
        """How long the daemon may take over an acquire or reserve before it answers with what
        it has (default: a quarter of ``timeout_s``)."""
        self._id = secrets.token_bytes(16)
        self._leases = itertools.count(secrets.randbelow(1 << 40) + 1)
        self._link = Link(self.socket_path, self._hello, timeout_s, retry_s, daemon_uid=daemon_uid,
                          map_arena=map_arena,
                          check_dir=socket_path is None and not os.environ.get("KVTIER_SOCKET"))
        self._namespace: Namespace | None = None

    @property
    def round_trips(self) -> tuple[int, float]:
        """Requests this client made of the daemon so far, and their seconds in all."""
        return self._link.round_trips, self._link.round_trip_s

    # -- connection ---------------------------------------------------------------------------
    def _hello(self) -> dict[str, object]:
        msg: dict[str, object] = {"op": "hello", "version": protocol.VERSION, "client": self._id,
                                  "pid": os.getpid(), "instance": self.instance}
        if self.layout is not None:
            lay = self.layout
            msg["namespace"] = {
                "model": self.model, "page_format": self.page_format, "tenant": self.tenant,
                "layout": {"num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads,
                           "head_dim": lay.head_dim, "dtype": lay.dtype,
                           "chunk_tokens": lay.chunk_tokens, "kv": lay.kv},
            }
        return msg

    # -- the link's settings -----------------------------------------------------------------
    @property
    def timeout_s(self) -> float:
        return self._link.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._link.timeout_s = value

    @property
    def retry_s(self) -> float:
        return self._link.retry_s

    @retry_s.setter
    def retry_s(self, value: float) -> None:
        self._link.retry_s = value

    @property
    def tier_names(self) -> list[str]:
        return self._link.tier_names

    @property
    def pin_arena(self) -> bool:
        """Page-lock the daemon's arena in this process when it is mapped (a worker copying to
        and from a GPU; default off: page-locking is a CUDA call, and a process that only asks
        questions -- vLLM's scheduler -- must not make a CUDA context)."""
        return self._link.pin_arena

    @pin_arena.setter
    def pin_arena(self, value: bool) -> None:
        with self._link.lock:
            self._link.set_pin(bool(value))

    def _can_map(self) -> None:
        if not self._link.map_arena:
            raise ValueError("this StoreClient maps no arena (map_arena=False): it cannot read or write chunks")

    def _sizes(self, n: int, tail_tokens: int) -> list[int]:
        """The bytes of each of ``n`` chunks of a request whose last is a partial chunk of
        ``tail_tokens`` tokens (0: all full)."""
        layout = self._need_layout()
        sizes = [layout.chunk_bytes] * n
        if tail_tokens:
            if not isinstance(tail_tokens, int) or not 0 < tail_tokens < layout.chunk_tokens:
                raise ValueError(f"tail_tokens must be in [1, {layout.chunk_tokens - 1}], got {tail_tokens!r}")
            sizes[-1] = layout.part_bytes(tail_tokens)
        return sizes

    def _budget_ms(self) -> int:
        """How long the daemon may take over an acquire or reserve (promoting, waiting for
        room) before it answers with what it has: well within this client's timeout."""
        budget = self.timeout_s / 4 if self.budget_s is None else min(self.budget_s, self.timeout_s / 4)
        return max(1, min(MAX_BUDGET_MS, int(budget * 1000)))

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        if not self._link.down_logged:
            log.warning("kvtier daemon at %s: %s failed (%s); serving as cache misses", self.socket_path, what, str(exc))  # a string: a record must not keep the frames (and views) alive
            self._link.down_logged = True

    # -- keys ---------------------------------------------------------------------------------
    def _need_layout(self) -> KVLayout:
        if self.layout is None:
            raise ValueError("this StoreClient has no namespace: give it a model and a layout")
        return self.layout

    def namespace(self) -> Namespace:
        """The namespace this client chains its tokens' keys under (model and layout; the
        daemon binds each key to the tenant it checked)."""
        layout = self._need_layout()
        if self._namespace is None:
            layout_id = layout.fingerprint + (f"/{self.page_format}" if self.page_format else "")
            self._namespace = Namespace(self.model, layout_id, "")  # type: ignore[arg-type]
        return self._namespace

    def keys_for(self, tokens: object) -> list[ChunkKey]:
        """The keys of the full chunks of ``tokens`` (as this client names them; the tenant is
        given with each request, or in the hello)."""
        layout = self._need_layout()
        return chunk_tokens_of(tokens, self.namespace(), layout.chunk_tokens).keys

    # -- leases -------------------------------------------------------------------------------
    def acquire(self, keys: Sequence[ChunkKey], *, first: int = 0, tenant: str | None = None,
                request: str | None = None, tail_tokens: int = 0) -> ReadLease | None:
        """Pin the longest held prefix of ``keys`` (chunks ``first, first + 1...`` of their
        sequence) in DRAM; None if nothing is held or the daemon is unavailable. With
        ``tail_tokens`` the last key is a partial chunk of that many tokens (its view is that
        size: :meth:`KVLayout.part_bytes`)."""
        if not keys:
            return None
        self._can_map()  # before the daemon grants anything
        sizes = self._sizes(len(keys), tail_tokens)
        lease_id = next(self._leases)
        try:
            with self._link.lock:
                conn = self._link.connect()
                reply = self._link.exchange(conn, {"op": "acquire", "lease": lease_id, "keys": list(keys),
                                                   "first": first, "tenant": tenant, "request": request,
                                                   "tail_tokens": tail_tokens, "budget_ms": self._budget_ms()})
                slots = reply.get("slots")
                tiers = reply.get("tiers")
                if not isinstance(slots, list) or not isinstance(tiers, list) or len(slots) > len(keys) \
                        or len(tiers) != len(slots):
                    self._link.drop(conn)
                    raise DaemonUnavailable("the daemon's acquire reply is malformed")
                if not slots:
                    return None
                if reply.get("lease") != lease_id:
                    self._link.drop(conn)
                    raise DaemonUnavailable("the daemon's acquire reply names another lease")
                try:
                    views = [conn.mapped().view(s, n) for s, n in zip(slots, sizes, strict=False)]
                except DaemonUnavailable:
                    self._link.drop(conn)  # its pins end with the connection
                    raise
                conn.mapped().refs += 1
                return ReadLease(lease_id, list(keys[: len(slots)]), views, [str(t) for t in tiers], conn)
        except DaemonUnavailable as exc:
            self._failed("acquire", exc)
            return None

    def release(self, lease: ReadLease, *, took: Sequence[int] | None = None, had: int = 0,
                failed: int = 0, wait_s: float | None = None) -> bool:
        """End a read lease; True if what was read through it can be trusted (the daemon held
        the pins the whole time). ``took``: tokens the engine used of each chunk (default: all),
        ``had``: tokens it already held itself, ``failed``: chunks it could not copy -- for the
        daemon's statistics; ``wait_s``: how long the engine's step waited for its loads (given
        by one rank of an engine: the daemon logs the load under its request,
        :mod:`kvtier.server.request_loads`)."""
        if lease.ended:
            raise ValueError(f"lease {lease.id} is already ended")
        lease.ended = True
        with self._link.lock:
            lease._conn.mapped().release()
            c = self.layout.chunk_tokens if self.layout else 0
            report = [c] * len(lease.keys) if took is None else [int(t) for t in took]
            try:
                more = {} if wait_s is None else {"wait_ms": min(3_600_000, max(0, round(wait_s * 1000)))}
                self._link.leased(lease._conn, "release", lease=lease.id, took=report, had=int(had),
                                  failed=int(failed), **more)
                return True
            except LeaseLost as exc:
                self.lost_leases += 1
                self._link.lost_chunks += len(lease.keys)
                log.warning("kvtier: read lease %d was lost (%s); its chunks are treated as misses", lease.id, str(exc))
                return False
            except DaemonUnavailable as exc:
                self.lost_leases += 1
                self._link.lost_chunks += len(lease.keys)
                self._failed("release", exc)
                return False

    def reserve(self, keys: Sequence[ChunkKey], *, first: int = 0, tenant: str | None = None,
                request: str | None = None, tail_tokens: int = 0) -> WriteLease | None:
        """DRAM slots for new chunks ``keys`` (chunks ``first...`` of their sequence), in order;
        shorter than ``keys`` when DRAM has no room. None if the daemon is unavailable. With
        ``tail_tokens`` the last key is a partial chunk of that many tokens: its slot is that
        size (:meth:`KVLayout.part_bytes`, each layer :meth:`KVLayout.part_layer_bytes`), in
        every tier. Fill the views -- all of each -- then :meth:`commit` (or :meth:`abandon`)."""
        if not keys:
            return None
        self._can_map()  # before the daemon grants anything
        sizes = self._sizes(len(keys), tail_tokens)
        lease_id = next(self._leases)
        try:
            with self._link.lock:
                conn = self._link.connect()
                try:
                    reply = self._link.exchange(conn, {"op": "reserve", "lease": lease_id, "keys": list(keys),
                                                       "first": first, "tenant": tenant, "request": request,
                                                       "tail_tokens": tail_tokens, "budget_ms": self._budget_ms()})
                except DaemonUnavailable:
                    if conn.broken:  # the daemon may have granted it; we never saw its slots
                        self._link.forget_later(conn, lease_id)
                    raise
                slots = reply.get("slots")
                if not isinstance(slots, list) or len(slots) > len(keys):
                    self._link.drop(conn)
                    self._link.forget_later(conn, lease_id)
                    raise DaemonUnavailable("the daemon's reserve reply is malformed")
                if not slots:
                    return None  # no room at all: every resident chunk is pinned or being written
                granted = reply.get("lease")
                if granted not in (None, lease_id) or (granted is None) != all(s in (HELD, BUSY) for s in slots):
                    self._link.drop(conn)
                    self._link.forget_later(conn, lease_id)
                    raise DaemonUnavailable("the daemon's reserve reply names another lease")
                try:
                    views = [None if s in (HELD, BUSY) else conn.mapped().view(s, n)
                             for s, n in zip(slots, sizes, strict=False)]
                except DaemonUnavailable:
                    self._link.drop(conn)  # its reservations are orphaned; we never wrote them
                    self._link.forget_later(conn, lease_id)
                    raise
                if granted is not None:
                    conn.mapped().refs += 1
                return WriteLease(granted, list(keys[: len(slots)]), views, [s == HELD for s in slots],
                                  conn if granted is not None else None, ended=granted is None)
        except DaemonUnavailable as exc:
            self._failed("reserve", exc)
            return None

    def commit(self, lease: WriteLease, written: Sequence[int] | None = None, ok: bool = True) -> int:
        """End a write lease: publish the chunks at indices ``written`` (default: every slot
        given), abandon the rest. Returns how many were stored (0 if the lease was lost)."""
        if lease.id is None or lease._conn is None:
            return 0
        if lease.ended:
            raise ValueError(f"lease {lease.id} is already ended")
        lease.ended = True
        if written is None:
            written = [i for i, v in enumerate(lease.views) if v is not None]
        with self._link.lock:
            conn = lease._conn
            conn.mapped().release()
            try:
                reply = self._link.leased(conn, "commit", lease=lease.id, written=list(written), success=ok)
                return int(reply.get("committed", 0))  # type: ignore[call-overload]
            except DaemonUnavailable as exc:
                # Lost: the daemon keeps its slots reserved until told nothing writes them.
                self.lost_leases += 1
                self._link.forget_later(conn, lease.id)
                if not isinstance(exc, LeaseLost):
                    self._failed("commit", exc)
                return 0

    def abandon(self, lease: WriteLease) -> None:
        self.commit(lease, [], ok=False)

    def close(self) -> None:
        """Close the connection (open leases are lost) and unmap the arena once no lease on it
        is open."""
        self._link.close()
