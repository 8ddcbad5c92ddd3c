"""``kvtier store serve``: one cache shared by many processes on one machine, for any model.

The daemon owns the chunk index, the policy, the DRAM tier (an arena in POSIX shared memory that
clients map), the SSD tier and the remote tier. Clients connect over a Unix socket for control
and move chunk bytes themselves, in place, in the shared arena. Each connection is served on a
thread of its own; the cache's lock is held for bookkeeping only (:mod:`kvtier.cache`).

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
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.cache import CacheConfig, ChunkCache, Slot
from kvtier.core.keys import ChunkKey, Namespace, bind_keys
from kvtier.core.layout import KVLayout
from kvtier.core.placement import Shape
from kvtier.errors import TierFullError
from kvtier.server import protocol
from kvtier.server.leases import Lease, LeaseEnded, Leases
from kvtier.server.protocol import BadRequest
from kvtier.server.runtime import (
    Peer,
    ProcessWatch,
    SocketClaim,
    new_arena_name,
    own_socket,
    peer_of,
    raise_fd_limit,
)
from kvtier.tiers.base import Reservation

log = logging.getLogger(__name__)

ANY_UID = "*"
REAP_INTERVAL_S = 0.5


@dataclass(frozen=True)
class AccessConfig:
    """Who may use the daemon, and how much of it."""

    mode: int = 0o600
    """Permissions of the socket and the arena. Engines running as other users need group
    access (0o660) and ``group``."""
    group: int | None = None
    """Group id given the socket and the arena (None: the daemon's)."""
    tenants: dict[str, tuple[str, ...]] | None = None
    """uid (as a string, or ``"*"`` for any other uid) -> the tenants it may use. None: any
    uid may use any tenant. A uid with no entry and no ``"*"`` is refused."""
    max_clients: int = 1024
    """Connections served at once; more are refused (counted), never left to fail mid-read."""
    orphan_grace_s: float = 600.0
    """How long the DRAM slots of a write lease whose connection ended stay reserved when the
    client's process cannot be watched and never says it stopped writing them."""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, int) or not 0 <= self.mode <= 0o777 or self.mode & 0o600 != 0o600:
            raise ValueError(f"access mode must be like 0o600 or 0o660 (the owner reads and writes), got {self.mode!r}")
        if self.group is not None and (not isinstance(self.group, int) or self.group < 0):
            raise ValueError(f"access group must be a group id, got {self.group!r}")
        if not isinstance(self.max_clients, int) or not 1 <= self.max_clients <= 1 << 20:
            raise ValueError(f"access max_clients must be an int in [1, 1048576], got {self.max_clients!r}")
        if not isinstance(self.orphan_grace_s, (int, float)) or self.orphan_grace_s < 0:
            raise ValueError(f"access orphan_grace_s must be seconds >= 0, got {self.orphan_grace_s!r}")
        if self.tenants is not None:
            for uid, names in self.tenants.items():
                if uid != ANY_UID and not (isinstance(uid, str) and uid.isdigit()):
                    raise ValueError(f"access tenants: keys are uids or '*', got {uid!r}")
                if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
                    raise ValueError(f"access tenants[{uid!r}] must be a list of tenant names")

    def allowed(self, uid: int, tenant: str) -> bool:
        if self.tenants is None:
            return True
        names = self.tenants.get(str(uid), self.tenants.get(ANY_UID))
        return names is not None and tenant in names


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: str
    cache: CacheConfig
    tenant: str = ""
    """The tenant of clients that name none."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1:PORT (0: any free port; None: off)."""
    access: AccessConfig = field(default_factory=AccessConfig)

    def __post_init__(self) -> None:
        import os

        if not isinstance(self.socket_path, str) or not self.socket_path:
            raise ValueError("socket_path must not be empty")
        parent = os.path.dirname(os.path.abspath(self.socket_path))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"cannot create the socket {self.socket_path}: {parent} is not a writable directory")
        if len(os.fsencode(self.socket_path)) > 100:
            raise ValueError(f"socket path {self.socket_path!r} is too long for a Unix socket")
        if self.cache.chunk is not None:
            raise ValueError("a daemon's cache serves any model: its config must not fix a chunk shape")
        if not isinstance(self.tenant, str):
            raise ValueError(f"tenant must be a string, got {self.tenant!r}")
        if self.metrics_port is not None and (not isinstance(self.metrics_port, int)
                                              or isinstance(self.metrics_port, bool)
                                              or not 0 <= self.metrics_port <= 65535):
            raise ValueError(f"metrics_port must be a TCP port in [0, 65535], got {self.metrics_port!r}")


@dataclass(frozen=True, slots=True)
class ClientNamespace:
    """What a connection's chunks are: the namespace its hello named."""

    model: str
    layout: KVLayout
    page_format: str
    tenant: str

    @property
    def shape(self) -> Shape:
        return Shape(self.layout.chunk_bytes, self.layout.layer_bytes)

    def namespace(self, tenant: str) -> Namespace:
        layout_id = self.layout.fingerprint + (f"/{self.page_format}" if self.page_format else "")
        return Namespace(self.model, layout_id, tenant)


_LAYOUT_BOUNDS = {"num_layers": 4096, "num_kv_heads": 4096, "head_dim": 1 << 16,
                  "chunk_tokens": 1 << 20, "kv": 2}


def parse_namespace(raw: object, default_tenant: str) -> ClientNamespace:
    """The namespace of a hello, checked (BadRequest naming the field)."""
    if not isinstance(raw, dict):
        raise BadRequest("namespace must be a map")
    model = protocol.text(raw, "model")
    if not model:
        raise BadRequest("namespace.model must be a non-empty string")
    lay = raw.get("layout")
    if not isinstance(lay, dict) or set(lay) - {*_LAYOUT_BOUNDS, "dtype"}:
        raise BadRequest(f"namespace.layout must be a map of {sorted({*_LAYOUT_BOUNDS, 'dtype'})}")
    args = {name: protocol.integer(lay, name, 1, hi, default=2 if name == "kv" else None)
            for name, hi in _LAYOUT_BOUNDS.items()}
    dtype = protocol.text(lay, "dtype", "float32")
    try:
        layout = KVLayout(dtype=dtype, **args)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"namespace.layout: {exc}") from None
    tenant = protocol.text(raw, "tenant")
    return ClientNamespace(model, layout, protocol.text(raw, "page_format", "") or "",
                           default_tenant if tenant is None else tenant)


class _Session:
    """One client connection and what it holds."""

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.watch = ProcessWatch(peer.pid)
        self.client = b""
        self.ns: ClientNamespace | None = None
        self.leases: dict[int, Lease] = {}
        self._bound: dict[str, Namespace] = {}

    def namespace(self, tenant: str) -> Namespace:
        ns = self._bound.get(tenant)
        if ns is None:
            assert self.ns is not None
            ns = self._bound[tenant] = self.ns.namespace(tenant)
        return ns


class StoreDaemon:
    """Serves one :class:`~kvtier.cache.ChunkCache` over a Unix socket. ``start()`` runs it in a
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
        try:
            arena = new_arena_name()
            self.claim.record_arena(arena)
            host = dataclasses.replace(config.cache.host, shm_name=arena, shm_mode=access.mode,
                                       shm_gid=access.group)
            self.cache = ChunkCache(dataclasses.replace(config.cache, host=host))
            self.leases = Leases(self.cache, access.orphan_grace_s)
            raise_fd_limit(access.max_clients + 256)
            daemon = self

            class Handler(socketserver.BaseRequestHandler):
                def handle(self) -> None:
                    daemon._serve_connection(self.request)

            class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
                daemon_threads = True

            self._server = Server(self.claim.socket_path, Handler)
            own_socket(self.claim.socket_path, access.mode, access.group)
        except BaseException:
            self._teardown()
            raise
        self._sessions: set[_Session] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
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
        self._server.serve_forever(poll_interval=0.2)

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:  # end every lease as a crash would
            try:
                session.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while self._sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            import os

            os.unlink(self.claim.socket_path)
        except FileNotFoundError:
            pass
        self.leases.close()
        self._teardown()

    def _reap(self) -> None:
        while not self._stopping.wait(REAP_INTERVAL_S):
            try:
                self.leases.reap()
            except Exception:
                log.exception("reaping orphaned leases failed")

    # -- connections --------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket) -> None:
        try:
            peer = peer_of(sock)
        except OSError:
            return
        session = _Session(sock, peer)
        with self._lock:
            full = len(self._sessions) >= self.config.access.max_clients
            if not full:
                self._sessions.add(session)
        if full:
            self.refused += 1
            log.warning("refusing a client (pid %d, uid %d): %d clients are connected already",
                        peer.pid, peer.uid, self.config.access.max_clients)
            try:
                protocol.recv(sock)
                protocol.send(sock, {"ok": False, "refused": True,
                                     "error": f"the daemon serves at most {self.config.access.max_clients} clients"})
            except (OSError, protocol.ProtocolError):
                pass
            session.watch.close()
            return
        try:
            while True:
                try:
                    request = protocol.recv(sock)
                except (protocol.ProtocolError, OSError) as exc:
                    log.warning("dropping a client: %s", exc)
                    return
                if request is None:
                    return
                start = time.perf_counter()
                op = request.get("op")
                handler = _OPS.get(op) if isinstance(op, str) else None
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
                self.observe(str(op), time.perf_counter() - start)
                try:
                    protocol.send(sock, reply)
                except (OSError, protocol.ProtocolError):
                    return
        finally:
            self._end_session(session)

    def _end_session(self, session: _Session) -> None:
        """The connection is gone: its read leases end now, its write leases are orphaned
        until nothing can still write their slots (:mod:`kvtier.server.leases`)."""
        pins, orphaned = self.leases.end(session.leases, session.watch)
        if pins or orphaned:
            log.info("client (pid %d) gone: released %d pins, orphaned %d reservations",
                     session.peer.pid, pins, orphaned)
        with self._lock:
            self._sessions.discard(session)

    # -- helpers ------------------------------------------------------------------------------
    def _ns(self, session: _Session) -> ClientNamespace:
        if session.ns is None:
            raise BadRequest("this operation needs a namespace (name one in the hello)")
        return session.ns

    def _bound(self, session: _Session, req: dict[str, object]) -> tuple[ClientNamespace, list[ChunkKey]]:
        """The request's keys bound to the namespace (and tenant) it may use."""
        ns = self._ns(session)
        tenant = protocol.text(req, "tenant")
        tenant = ns.tenant if tenant is None else tenant
        if not self.config.access.allowed(session.peer.uid, tenant):
            raise BadRequest(f"uid {session.peer.uid} may not use tenant {tenant!r}")
        keys = bind_keys(session.namespace(tenant), protocol.keys(req))
        assert self.cache is not None
        self.cache.tag(keys, tenant)
        return ns, keys

    def _use(self, req: dict[str, object]) -> int | None:
        assert self.cache is not None
        return self.cache.use_of(protocol.text(req, "request"))

    # -- operations ---------------------------------------------------------------------------
    def _hello(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        version = req.get("version")
        if version != protocol.VERSION:
            return {"ok": False, "refused": True,
                    "error": f"protocol version {version!r} is not this daemon's ({protocol.VERSION})"}
        client = req.get("client")
        if not isinstance(client, bytes) or len(client) != 16:
            raise BadRequest("hello needs a 16-byte client id")
        assert self.cache is not None
        if req.get("namespace") is not None:
            ns = parse_namespace(req["namespace"], self.config.tenant)
            if not self.config.access.allowed(session.peer.uid, ns.tenant):
                return {"ok": False, "refused": True,
                        "error": f"uid {session.peer.uid} may not use tenant {ns.tenant!r}"}
            refusal = self._cannot_hold(ns)
            if refusal:
                return {"ok": False, "refused": True, "error": refusal}
            session.ns = ns
        session.client = client
        host = self.cache.host
        return {"ok": True, "version": protocol.VERSION, "epoch": self.epoch,
                "shm_name": host.arena.shm_name, "arena_bytes": host.arena.size,
                "tiers": [t.name for t in self.cache.tiers],
                "tenant": session.ns.tenant if session.ns else self.config.tenant}

    def _cannot_hold(self, ns: ClientNamespace) -> str | None:
        assert self.cache is not None
        shape = ns.shape
        try:
            self.cache.host.stride_for(shape.nbytes)
        except ValueError as exc:
            return f"this daemon cannot hold chunks of this layout: {exc}"
        for tier in self.cache.tiers[1:]:
            if tier.footprint(shape.nbytes, shape.segment_bytes) > tier.capacity:
                return (f"this daemon cannot hold chunks of this layout: a chunk of {shape.nbytes} "
                        f"bytes is larger than the {tier.name} tier ({tier.capacity} bytes)")
        return None

    def _lookup(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        ns, keys = self._bound(session, req)
        c = ns.layout.chunk_tokens
        n = protocol.integer(req, "num_tokens", len(keys) * c, len(keys) * c + c - 1, default=len(keys) * c)
        assert self.cache is not None
        hit = self.cache.lookup_keys(keys, use=self._use(req))
        self.cache.count(lookup_tokens=n, hit_tokens=len(hit) * c)
        return {"ok": True, "tiers": [self.cache.tiers[lvl].name for lvl in hit.levels]}

    def _acquire(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        ns, keys = self._bound(session, req)
        lease_id = protocol.integer(req, "lease", 1, protocol.MAX_LEASE)
        first = protocol.integer(req, "first", 0, protocol.MAX_KEYS * 256, default=0)
        if lease_id in session.leases:
            raise BadRequest(f"lease {lease_id} is already held on this connection")
        assert self.cache is not None
        use = self._use(req)
        held = self.cache.acquire(keys, entry=ns.shape, start=first, use=use)
        if held:
            self.leases.grant(session.leases, Lease(lease_id, session.client, False, [h.key for h in held],
                                                    first, use, sources=[h.source for h in held]))
        return {"ok": True, "lease": lease_id if held else None, "slots": [h.offset for h in held],
                "tiers": [h.source for h in held]}

    def _release(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        lease_id = protocol.integer(req, "lease", 1, protocol.MAX_LEASE)
        lease = self.leases.take(session.leases, lease_id, write=False)
        ns = self._ns(session)
        assert self.cache is not None
        self.cache.release(lease.keys)
        try:
            took = protocol.integers(req, "took", 0, ns.layout.chunk_tokens, limit=len(lease.keys))
            had = protocol.integer(req, "had", 0, protocol.MAX_TOKENS, default=0)
            failed = protocol.integer(req, "failed", 0, len(lease.keys), default=0)
        except BadRequest:
            return {"ok": True}  # the pins are released anyway; a bad report is not counted
        self.cache.count_loaded(zip(lease.sources, took, strict=False), had=had, failed=failed)
        return {"ok": True}

    def _reserve(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        ns, keys = self._bound(session, req)
        lease_id = protocol.integer(req, "lease", 1, protocol.MAX_LEASE)
        first = protocol.integer(req, "first", 0, protocol.MAX_KEYS * 256, default=0)
        if lease_id in session.leases:
            raise BadRequest(f"lease {lease_id} is already held on this connection")
        assert self.cache is not None
        lease = Lease(lease_id, session.client, True, keys, first, self._use(req))
        slots: list[int] = []
        present = busy = 0
        try:
            for i, key in enumerate(keys):
                try:
                    res = self.cache.reserve(key, ns.shape, position=first + i, remaining=len(keys) - i)
                except TierFullError:
                    break
                if res is Slot.HELD:
                    slots.append(-1)  # already held: nothing to write
                    present += 1
                elif res is Slot.BUSY:
                    slots.append(-2)  # another client is writing it now: skip it
                    busy += 1
                else:
                    assert isinstance(res, Reservation)
                    lease.writes[i] = res
                    slots.append(int(res.slot))  # type: ignore[call-overload]
        except BaseException:
            for res in lease.writes.values():
                self.cache.commit(res, ok=False)
            raise
        self.cache.count(dedup_chunks=present, busy_chunks=busy)
        if lease.writes:
            self.leases.grant(session.leases, lease)
        return {"ok": True, "lease": lease_id if lease.writes else None, "slots": slots}

    def _commit(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        lease_id = protocol.integer(req, "lease", 1, protocol.MAX_LEASE)
        lease = self.leases.take(session.leases, lease_id, write=True)
        assert self.cache is not None
        try:
            written = set(protocol.integers(req, "written", 0, protocol.MAX_KEYS))
            protocol.within(list(written), len(lease.keys), "written")
            ok = req.get("success", True) is True
        except BadRequest:
            for res in lease.writes.values():
                self.cache.commit(res, ok=False)
            raise
        done = 0
        for i, res in lease.writes.items():
            done += bool(self.cache.commit(res, ok=ok and i in written, position=lease.first + i))
        if done:
            self.cache.touch(lease.keys, start=lease.first, use=lease.use)
        return {"ok": True, "committed": done}

    def _forget(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        ids = protocol.integers(req, "leases", 1, protocol.MAX_LEASE)
        return {"ok": True, "freed": self.leases.forget(session.client, ids)}

    def _prefetch(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        ns, keys = self._bound(session, req)
        first = protocol.integer(req, "first", 0, protocol.MAX_KEYS * 256, default=0)
        wait = req.get("wait", False) is True
        assert self.cache is not None
        n = self.cache.prefetch(keys, start=first, use=self._use(req), entry=ns.shape, wait=wait)
        return {"ok": True, "promoted": n}

    def _queued(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        ns, keys = self._bound(session, req)
        request_id = protocol.text(req, "request_id")
        if not request_id:
            raise BadRequest("queued needs a request_id")
        wait = req.get("wait", False) is True
        assert self.cache is not None
        return {"ok": True, "promoted": self.cache.queued(request_id, keys, entry=ns.shape, wait=wait)}

    def _started(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        request_id = protocol.text(req, "request_id")
        if not request_id:
            raise BadRequest("started needs a request_id")
        assert self.cache is not None
        self.cache.started(request_id)
        return {"ok": True}

    def _finished(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        request_id = protocol.text(req, "request_id")
        if request_id:
            assert self.cache is not None
            self.cache.finished(request_id)
        return {"ok": True}

    def _stats(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        return {"ok": True, "stats": self.snapshot()}

    def _flush(self, req: dict[str, object], session: _Session) -> dict[str, object]:
        timeout = protocol.integer(req, "timeout_s", 0, 3600, default=30)
        assert self.cache is not None
        return {"ok": True, "done": self.cache.flush(timeout)}

    def snapshot(self) -> dict[str, object]:
        assert self.cache is not None
        snap = self.cache.snapshot()
        with self._lock:
            sessions = list(self._sessions)
        snap["clients"] = len(sessions)
        snap["refused_clients"] = self.refused
        snap["pinned_chunks"] = sum(len(lease.keys) for s in sessions for lease in list(s.leases.values())
                                    if not lease.write)
        snap["writes_in_flight"] = sum(len(lease.writes) for s in sessions for lease in list(s.leases.values())
                                       if lease.write)
        snap["orphaned_writes"] = self.leases.orphaned()
        snap["arena"] = self.arena_name
        return snap


_OPS: dict[str, Callable[[StoreDaemon, dict[str, object], _Session], dict[str, object]]] = {
    "hello": StoreDaemon._hello,
    "lookup": StoreDaemon._lookup,
    "acquire": StoreDaemon._acquire,
    "release": StoreDaemon._release,
    "reserve": StoreDaemon._reserve,
    "commit": StoreDaemon._commit,
    "forget": StoreDaemon._forget,
    "prefetch": StoreDaemon._prefetch,
    "queued": StoreDaemon._queued,
    "started": StoreDaemon._started,
    "finished": StoreDaemon._finished,
    "stats": StoreDaemon._stats,
    "flush": StoreDaemon._flush,
}
"""Operation name -> handler."""
