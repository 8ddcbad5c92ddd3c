"""``kvtier store serve``: one cache shared by many processes on one machine, for any model.

The daemon owns the chunk index, the policy, the DRAM tier (an arena in POSIX shared memory that
clients map), the SSD tier and the remote tier. Clients connect over a Unix socket for control
and move chunk bytes themselves, in place, in the shared arena. The cache's lock is held for
bookkeeping only (:mod:`kvtier.store.cache`).

Connections (:mod:`kvtier.server.connections`): a connection that is talking is served on a
thread of its own, one request after the other, as long as requests keep coming; one idle for
:data:`~kvtier.server.connections.PARK_S` is *parked* -- watched by the one event-loop thread,
holding no thread -- until its next request. Many idle clients (a vLLM scheduler's hint
connection, engines between conversations) cost a file descriptor each, not a thread; a client
refused for ``max_clients`` gets its refusal from the event loop and never a thread.

A client names its namespace in its ``hello``: the model fingerprint, the KV layout and page
format, and its tenant. The daemon needs no model: every key a client sends is bound to that
namespace (:func:`kvtier.core.keys.bind_keys`), so chunks of different models, layouts or
tenants never match, and a client can reach only the namespaces its uid may use
(:class:`AccessConfig`). A layout the daemon cannot hold (a chunk larger than a DRAM extent or
than the SSD tier) is refused in the ``hello`` with a message saying why; the client then runs
as cache misses.

Operations (``kvtier.server.protocol``): ``hello``, ``lookup``, ``acquire`` / ``release``
(a read lease: DRAM pins), ``reserve`` / ``commit`` (a write lease: DRAM slots), ``forget``
(orphaned write leases the client has ended), ``prefetch``, ``queued`` / ``started`` /
``finished`` (the scheduler's hooks), ``stats``, ``flush``. Leases: :mod:`kvtier.server.leases`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping

from kvtier.core.keys import ROOT_KEY, ChunkKey, bind_keys, chunk_tokens_of, tail_key
from kvtier.server import protocol
from kvtier.server.connections import Connections
from kvtier.server.leases import LeaseEnded, Leases
from kvtier.server.ops import OPS
from kvtier.server.protocol import BadRequest
from kvtier.server.request_loads import RequestLoads
from kvtier.server.runtime import (
    SocketClaim,
    new_arena_name,
    own_socket,
    peer_of,
    raise_fd_limit,
)
from kvtier.server.session import Session
from kvtier.server.settings import (  # noqa: F401 - AccessConfig: re-exported with the daemon
    AccessConfig,
    ClientNamespace,
    DaemonConfig,
)
from kvtier.store.cache import ChunkCache

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.5


@dataclasses.dataclass(frozen=True)
class HeldPrefix:
    """What :meth:`StoreDaemon.held` found: full chunks from the first, then maybe a partial one."""

    chunk_tiers: list[str] = dataclasses.field(default_factory=list)
    """The fastest tier holding each held full chunk, in order."""
    tail_tokens: int = 0
    """Tokens of the partial chunk held after them (0: none)."""
    tail_tier: str | None = None


class StoreDaemon:
    """Serves one :class:`~kvtier.store.cache.ChunkCache` over a Unix socket. ``start()`` runs it in a
    thread; ``serve_forever`` in the caller's. ``observe(op, seconds)`` is called after every
    operation (the metrics' latency histogram)."""

    def __init__(self, config: DaemonConfig,
                 observe: Callable[[str, float], None] | None = None) -> None:
        self.config = config
        self.observe = observe or (lambda op, seconds: None)
        self.epoch = secrets.token_bytes(16)
        self.refused = 0
        access = config.access
        self.claim = SocketClaim(config.socket_path)
        self.cache: ChunkCache | None = None
        self._sessions: set[Session] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        try:
            arena = new_arena_name()
            self.claim.record_arena(arena)
            # the daemon copies between DRAM and SSD only: it page-locks its arena (and makes a
            # CUDA context) only when told to; each client that copies to a GPU pins its own mapping
            host = dataclasses.replace(config.cache.host, shm_name=arena, shm_mode=access.mode,
                                       shm_gid=access.group, pin_memory=bool(config.cache.host.pin_memory))
            self.cache = ChunkCache(dataclasses.replace(config.cache, host=host))
            self.leases = Leases(self.cache, access.lease_ttl_s, access.orphan_report_s)
            self.request_loads = RequestLoads()
            raise_fd_limit(2 * access.max_clients + 256)  # a socket and a pidfd per client
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(self.claim.socket_path)
                own_socket(self.claim.socket_path, access.mode, access.group)
                listener.listen(min(4096, access.max_clients + 64))
            except BaseException:
                listener.close()
                raise
            self._connections = Connections(listener, self._serve_request, self._accepted,
                                            self._ended, self._refusal)
        except BaseException:
            self._teardown()
            raise
        self._thread: threading.Thread | None = None
        self._reaper = threading.Thread(target=self._reap, name="kvtier-daemon-reaper", daemon=True)
        self._reaper.start()

    @property
    def arena_name(self) -> str:
        assert self.cache is not None
        return str(self.cache.host.arena.shm_name)

    def _teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.claim.record_arena(None)
        self.claim.release()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> StoreDaemon:
        self._thread = threading.Thread(target=self.serve_forever, name="kvtier-daemon", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        log.info("kvtier store daemon serving %s", self.config.socket_path)
        self._connections.run()

    def stop(self) -> None:
        self._stopping.set()
        self._connections.stop()  # ends every connection as a crash would: their leases end
        deadline = time.monotonic() + 5
        while self._sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            os.unlink(self.claim.socket_path)
        except FileNotFoundError:
            pass
        self.leases.close()
        self._teardown()

    def _reap(self) -> None:
        while not self._stopping.wait(REAP_INTERVAL_S):
            try:
                with self._lock:
                    held = [s.leases for s in self._sessions]
                self.leases.expire(held)
                self.leases.reap()
            except Exception:
                log.exception("reaping leases failed")

    # -- connections --------------------------------------------------------------------------
    def _accepted(self, sock: socket.socket) -> Session | None:
        """A new connection: its session, or None to refuse it (``max_clients``)."""
        try:
            peer = peer_of(sock)
        except OSError:
            return None
        with self._lock:
            if len(self._sessions) >= self.config.access.max_clients:
                self.refused += 1
                log.warning("refusing a client (pid %d, uid %d): %d clients are connected already",
                            peer.pid, peer.uid, self.config.access.max_clients)
                return None
            session = Session(sock, peer)
            self._sessions.add(session)
        return session

    def _refusal(self) -> dict[str, object]:
        return {"ok": False, "refused": True,
                "error": f"the daemon serves at most {self.config.access.max_clients} clients"}

    def _serve_request(self, session: Session, request: dict[str, object]) -> dict[str, object]:
        start = time.perf_counter()
        op = request.get("op")
        handler = OPS.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise BadRequest(f"unknown operation {op!r:.40}")
            if op != "hello" and not session.client:
                raise BadRequest("the first request must be a hello")
            reply = handler(self, request, session)
        except LeaseEnded as exc:
            reply = {"ok": False, "lost": True, "error": f"{op}: {exc}"}
        except (ValueError, TypeError, KeyError) as exc:
            reply = {"ok": False, "error": f"{op}: {exc}"}
        self.observe(str(op) if handler is not None else "unknown", time.perf_counter() - start)  # bounded labels
        return reply

    def _ended(self, session: Session) -> None:
        """The connection is gone: its read leases end now, its write leases are orphaned
        until nothing can still write their slots (:mod:`kvtier.server.leases`)."""
        pins, orphaned = self.leases.end(session.leases, session.watch, session.owner)
        if pins or orphaned:
            log.info("client (pid %d) gone: released %d pins, orphaned %d reservations",
                     session.peer.pid, pins, orphaned)
        with self._lock:
            self._sessions.discard(session)

    # -- helpers ------------------------------------------------------------------------------
    def namespace_of(self, session: Session) -> ClientNamespace:
        if session.ns is None:
            raise BadRequest("this operation needs a namespace (name one in the hello)")
        return session.ns

    def bound(self, session: Session, req: dict[str, object]) -> tuple[ClientNamespace, list[ChunkKey], str]:
        """The request's keys bound to the namespace (and tenant) it may use, and that tenant."""
        ns = self.namespace_of(session)
        tenant = protocol.text(req, "tenant")
        tenant = ns.tenant if tenant is None else tenant
        if not self.config.access.allowed(session.peer.uid, tenant):
            raise BadRequest(f"uid {session.peer.uid} may not use tenant {tenant!r}")
        keys = bind_keys(session.namespace(tenant), protocol.keys(req))
        return ns, keys, tenant

    def namespaces(self) -> list[ClientNamespace]:
        """The distinct namespaces the live connections named in their hellos (sorted by model,
        page format, tenant). Holds the daemon's lock only to copy the set of connections."""
        with self._lock:
            sessions = list(self._sessions)
        named = {s.ns for s in sessions if s.ns is not None}
        return sorted(named, key=lambda ns: (ns.model, ns.page_format, ns.tenant, ns.layout.fingerprint))

    def held(self, ns: ClientNamespace, tokens: list[int], extras: Mapping[int, bytes] | None = None,
             block_tokens: int = 0) -> HeldPrefix:
        """How much of ``tokens`` the cache holds under ``ns`` (chained as its clients chain them,
        with ``extras``, bound to its tenant): the longest run of full chunks, then the longest
        partial chunk of whole blocks of ``block_tokens`` after it (as the vLLM connector saves a
        finished request's tail; 0: none). Read-only, as the ``probe`` operation: touches no
        policy, counts nothing, takes no lock, does no I/O (a remote tier answers only for the
        chunks the index knows it holds). The caller checks that its asker may read
        ``ns.tenant``. Advice: a chunk may be evicted right after."""
        assert self.cache is not None
        names = [t.name for t in self.cache.tiers]
        chain_ns, bound_ns, c = ns.namespace(""), ns.namespace(ns.tenant), ns.layout.chunk_tokens
        keys = chunk_tokens_of(tokens, chain_ns, c, extras).keys
        found = self.cache.held(bind_keys(bound_ns, keys), tenant=ns.tenant)
        m = next((i for i, lvl in enumerate(found) if lvl is None), len(found))
        tiers = [names[lvl] for lvl in found[:m]]  # type: ignore[index]
        room = min(c // block_tokens - 1, (len(tokens) - m * c) // block_tokens) if block_tokens else 0
        if room <= 0:
            return HeldPrefix(tiers)
        sizes = range(room * block_tokens, 0, -block_tokens)
        parent, extra = keys[m - 1] if m else ROOT_KEY, (extras or {}).get(m)
        tails = [tail_key(parent, chain_ns, tokens[m * c: m * c + n], extra) for n in sizes]
        lvl, n = next(((lvl, n) for lvl, n in zip(self.cache.held(bind_keys(bound_ns, tails), tenant=ns.tenant),
                                                  sizes, strict=True) if lvl is not None), (None, 0))
        return HeldPrefix(tiers, n, None if lvl is None else names[lvl])

    @staticmethod
    def request_name(session: Session, request_id: str | None) -> str | None:
        """A request id as the cache knows it: per instance the client names in its hello (a
        vLLM instance's scheduler and workers share one), else per process (two vLLM instances
        both number their requests "0", "1", ...)."""
        return None if request_id is None else f"{session.instance}/{request_id}"

    def use_of(self, req: dict[str, object], session: Session, *, finished: bool = False,
               arrived: bool = False) -> int | None:
        """The cache's number of the request ``req`` names (``finished``: also one that
        finished lately, for a save of its reply; ``arrived``: one not announced yet is
        announced now -- its lookup overtook its ``queued`` hint on another connection)."""
        assert self.cache is not None
        name = self.request_name(session, protocol.text(req, "request"))
        if arrived:
            return self.cache.arrived(name)
        return self.cache.use_of(name, finished=finished)

    def snapshot(self) -> dict[str, object]:
        assert self.cache is not None
        snap = self.cache.snapshot()
        with self._lock:
            sessions = list(self._sessions)
        leased, writing = self.leases.counts(s.leases for s in sessions)
        host = snap["tiers"]["host"]  # type: ignore[index]
        snap["clients"] = len(sessions)
        snap["refused_clients"] = self.refused
        snap["pinned_chunks"] = host["pinned"]  # type: ignore[index]
        """DRAM chunks pinned now, by anyone: clients' read leases, uploads, moves."""
        snap["leased_pins"] = leased
        snap["writes_in_flight"] = writing
        snap["orphaned_writes"] = self.leases.orphaned()
        snap["quarantined_writes"] = self.leases.quarantined()
        snap["expired_reads"] = self.leases.expired_reads
        snap["fenced_writes"] = self.leases.fenced_writes
        snap["threads"] = threading.active_count()
        snap["arena"] = self.arena_name
        return snap
