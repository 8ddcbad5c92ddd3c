"""Client of the store daemon: the store API (lookup / load / save / prefetch) for processes that
share the daemon's DRAM arena, and its lease-level calls for engines that copy their own pages.

    client = StoreClient(socket, model="llama@rev", layout=layout)   # the namespace, in the hello
    hit = client.lookup(tokens)
    client.load(hit, out)                   # copies through read leases, validated
    client.save(tokens, kv)                 # writes through write leases

Every failure to reach the daemon -- down at start, killed mid-run, restarting, stalled past
``timeout_s``, of another protocol version, refusing this namespace, an arena this process
cannot map -- is a cache miss: logged once per outage, counted in :attr:`StoreClient.errors`,
never raised. The client reconnects (at most once per ``retry_s``) when the daemon is back.

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
import socket
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.core.keys import ChunkKey, Namespace, chunk_tokens_of
from kvtier.core.layout import KVLayout
from kvtier.errors import DaemonUnavailable, LeaseLost
from kvtier.server import protocol
from kvtier.server.runtime import ARENA_NAME, default_socket_path, peer_of
from kvtier.store_types import LoadResult, LookupResult, SaveResult
from kvtier.tiers.base import PAGE
from kvtier.tiers.host import SHM_DIR, HostArena
from kvtier.transfer import LayerKV, check_kv, pack_chunk, unpack_layer

log = logging.getLogger(__name__)

MAX_ARENA = 1 << 46
HELD, BUSY = -1, -2


class _Arena:
    """A daemon's arena mapped here, unmapped only once it is retired (its daemon is gone or
    the client closes) and no lease on it is open."""

    def __init__(self, name: str, size: int, owner_uid: int) -> None:
        if not isinstance(name, str) or not ARENA_NAME.fullmatch(name):
            raise DaemonUnavailable(f"the daemon named an arena {name!r:.80}, not a kvtier arena name")
        if not isinstance(size, int) or not 0 < size <= MAX_ARENA or size % PAGE:
            raise DaemonUnavailable(f"the daemon gave an arena size of {size!r:.40}")
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise DaemonUnavailable(f"{path} is not a regular file")
            if st.st_uid != owner_uid:
                raise DaemonUnavailable(f"{path} belongs to uid {st.st_uid}, the daemon runs as {owner_uid}")
            self.arena = HostArena.attach(name, size)
        except (OSError, ValueError) as exc:
            raise DaemonUnavailable(f"cannot map the daemon's arena {path}: {exc}") from exc
        if torch.cuda.is_available():
            self.arena.pin()  # page-locked: device copies from the arena run at full speed
        self.name = name
        self.size = size
        self.refs = 0
        self.retired = False

    def view(self, offset: object, nbytes: int) -> torch.Tensor:
        if (not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset % PAGE
                or offset + nbytes > self.size):
            raise DaemonUnavailable(f"the daemon gave slot offset {offset!r:.40} outside its arena")
        return self.arena.tensor[offset : offset + nbytes]

    def release(self) -> None:
        self.refs -= 1
        self._maybe_close()

    def retire(self) -> None:
        self.retired = True
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.retired and self.refs <= 0:
            self.arena.close()


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    epoch: bytes
    arena: _Arena
    tiers: list[str]
    broken: bool = False


@dataclass(eq=False)
class ReadLease:
    """DRAM pins on the longest held prefix of the keys asked for: ``views[i]`` holds chunk
    ``keys[i]``'s bytes (see the module docstring for how long)."""

    id: int
    keys: list[ChunkKey]
    views: list[torch.Tensor]
    tiers: list[str]
    """Where each chunk was found (``host``, or the tier it was promoted from)."""
    _conn: _Conn = field(repr=False)
    ended: bool = False


@dataclass(eq=False)
class WriteLease:
    """DRAM slots to write new chunks into: ``views[i]`` for ``keys[i]``, None where there is
    nothing to write (``held[i]``: already stored; else being written by someone else now)."""

    id: int | None
    keys: list[ChunkKey]
    views: list[torch.Tensor | None]
    held: list[bool]
    _conn: _Conn | None = field(repr=False)
    ended: bool = False


class StoreClient:
    """Thread-safe; one connection at a time, requests serialized."""

    def __init__(self, socket_path: str | None = None, *, model: str | None = None,
                 layout: KVLayout | None = None, tenant: str | None = None, page_format: str = "",
                 timeout_s: float = 5.0, retry_s: float = 1.0) -> None:
        if (model is None) != (layout is None):
            raise ValueError("StoreClient needs both model and layout (a namespace), or neither")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("StoreClient model must be a non-empty string (the weights' fingerprint)")
        self.socket_path = socket_path or default_socket_path()
        self.model = model
        self.layout = layout
        self.tenant = tenant
        self.page_format = page_format
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.errors = 0
        """Requests that failed because the daemon was unreachable or answered an error."""
        self.lost_leases = 0
        """Leases that ended before their holder ended them (what they read was thrown away)."""
        self._id = secrets.token_bytes(16)
        self._leases = itertools.count(secrets.randbelow(1 << 40) + 1)
        self._lock = threading.RLock()
        self._conn: _Conn | None = None
        self._arena: _Arena | None = None
        self._next_try = 0.0
        self._down_logged = False
        self._refused: str | None = None
        self._forget: dict[bytes, list[int]] = {}
        self._namespaces: dict[str, Namespace] = {}
        self.tier_names: list[str] = ["host"]

    # -- connection ---------------------------------------------------------------------------
    def _hello(self) -> dict[str, object]:
        msg: dict[str, object] = {"op": "hello", "version": protocol.VERSION, "client": self._id,
                                  "pid": os.getpid()}
        if self.layout is not None:
            lay = self.layout
            msg["namespace"] = {
                "model": self.model, "page_format": self.page_format, "tenant": self.tenant,
                "layout": {"num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads,
                           "head_dim": lay.head_dim, "dtype": lay.dtype,
                           "chunk_tokens": lay.chunk_tokens, "kv": lay.kv},
            }
        return msg

    def _connect(self) -> _Conn:
        if self._conn is not None and not self._conn.broken:
            return self._conn
        now = time.monotonic()
        if now < self._next_try:
            raise DaemonUnavailable(self._refused or "daemon unreachable; retrying later")
        self._next_try = now + self.retry_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
            daemon = peer_of(sock)
            protocol.send(sock, self._hello())
            hello = protocol.recv(sock)
        except (OSError, protocol.ProtocolError) as exc:
            sock.close()
            raise DaemonUnavailable(f"{self.socket_path}: {exc}") from exc
        try:
            conn = self._attach(sock, hello, daemon.uid)
        except DaemonUnavailable:
            sock.close()
            raise
        self._conn = conn
        self._refused = None
        if self._down_logged:
            log.warning("kvtier daemon at %s is back", self.socket_path)
            self._down_logged = False
        self._send_forgets(conn)
        return conn

    def _attach(self, sock: socket.socket, hello: dict[str, object] | None, daemon_uid: int) -> _Conn:
        if hello is None:
            raise DaemonUnavailable("the daemon closed the connection at hello")
        if not hello.get("ok"):
            error = str(hello.get("error"))[:500]
            if hello.get("refused"):
                self._refused = f"the daemon refused this client: {error}"
                if not self._down_logged:
                    log.error("kvtier daemon at %s refused this client: %s; serving as cache misses",
                              self.socket_path, error)
            raise DaemonUnavailable(self._refused or error)
        if hello.get("version") != protocol.VERSION:
            raise DaemonUnavailable(f"the daemon speaks protocol {hello.get('version')!r:.20}, this client {protocol.VERSION}")
        epoch = hello.get("epoch")
        if not isinstance(epoch, bytes) or len(epoch) != 16:
            raise DaemonUnavailable("the daemon's hello has no epoch")
        tiers = hello.get("tiers")
        if isinstance(tiers, list) and all(isinstance(t, str) for t in tiers) and len(tiers) <= 8:
            self.tier_names = list(tiers)
        name, size = hello.get("shm_name"), hello.get("arena_bytes")
        arena = self._arena
        if arena is None or arena.name != name or arena.size != size:
            arena = _Arena(name, size, daemon_uid)  # type: ignore[arg-type]
            if self._arena is not None:
                self._arena.retire()  # the old daemon's: unmapped once its last lease ends
            self._arena = arena
        return _Conn(sock, epoch, arena, self.tier_names)

    def _send_forgets(self, conn: _Conn) -> None:
        ids = self._forget.pop(conn.epoch, None)
        self._forget.clear()  # leases of other daemon instances died with them
        if ids:
            try:
                self._exchange(conn, {"op": "forget", "leases": ids})
            except DaemonUnavailable:
                self._forget.setdefault(conn.epoch, []).extend(ids)

    def _break(self, conn: _Conn) -> None:
        """The connection is unusable (an error, a timeout: the reply stream is unknown). Its
        leases are lost; no request is sent on it again."""
        if conn.broken:
            return
        conn.broken = True
        try:
            conn.sock.close()
        except OSError:
            pass
        if self._conn is conn:
            self._conn = None
        self._next_try = time.monotonic() + self.retry_s

    def _exchange(self, conn: _Conn, message: dict[str, object]) -> dict[str, object]:
        try:
            protocol.send(conn.sock, message)
            reply = protocol.recv(conn.sock)
        except (OSError, protocol.ProtocolError) as exc:
            self._break(conn)
            raise DaemonUnavailable(str(exc) or type(exc).__name__) from exc
        if reply is None:
            self._break(conn)
            raise DaemonUnavailable("the daemon closed the connection")
        if not reply.get("ok"):
            if reply.get("lost"):
                raise LeaseLost(str(reply.get("error")))
            raise DaemonUnavailable(str(reply.get("error"))[:500])
        return reply

    def _call(self, op: str, **fields: object) -> tuple[_Conn, dict[str, object]]:
        """A request that holds nothing: tried once more on a new connection if the one it
        went out on had been up before (the daemon may have restarted since)."""
        with self._lock:
            for attempt in (0, 1):
                had = self._conn is not None and not self._conn.broken
                conn = self._connect()
                try:
                    return conn, self._exchange(conn, {"op": op, **fields})
                except LeaseLost:
                    raise
                except DaemonUnavailable:
                    if attempt or not had or not conn.broken:
                        raise
                    self._next_try = 0.0
            raise DaemonUnavailable("unreachable")  # pragma: no cover - the loop returns or raises

    def _leased(self, conn: _Conn | None, op: str, **fields: object) -> dict[str, object]:
        """A request about a lease: only ever on the lease's own connection."""
        with self._lock:
            if conn is None or conn.broken or conn is not self._conn:
                raise LeaseLost(f"{op}: the connection that held the lease is gone")
            return self._exchange(conn, {"op": op, **fields})

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        if not self._down_logged:
            log.warning("kvtier daemon at %s: %s failed (%s); serving as cache misses", self.socket_path, what, exc)
            self._down_logged = True

    # -- keys ---------------------------------------------------------------------------------
    def _need_layout(self) -> KVLayout:
        if self.layout is None:
            raise ValueError("this StoreClient has no namespace: give it a model and a layout")
        return self.layout

    def namespace(self) -> Namespace:
        """The namespace this client chains its tokens' keys under (model and layout; the
        daemon binds each key to the tenant it checked)."""
        layout = self._need_layout()
        ns = self._namespaces.get("")
        if ns is None:
            layout_id = layout.fingerprint + (f"/{self.page_format}" if self.page_format else "")
            ns = self._namespaces[""] = Namespace(self.model, layout_id, "")  # type: ignore[arg-type]
        return ns

    def keys_for(self, tokens: object) -> list[ChunkKey]:
        """The keys of the full chunks of ``tokens`` (as this client names them; the tenant is
        given with each request, or in the hello)."""
        layout = self._need_layout()
        return chunk_tokens_of(tokens, self.namespace(), layout.chunk_tokens).keys

    # -- leases -------------------------------------------------------------------------------
    def acquire(self, keys: Sequence[ChunkKey], *, first: int = 0, tenant: str | None = None,
                request: str | None = None) -> ReadLease | None:
        """Pin the longest held prefix of ``keys`` (chunks ``first, first + 1...`` of their
        sequence) in DRAM; None if nothing is held or the daemon is unavailable."""
        layout = self._need_layout()
        if not keys:
            return None
        lease_id = next(self._leases)
        try:
            with self._lock:
                conn = self._connect()
                reply = self._exchange(conn, {"op": "acquire", "lease": lease_id, "keys": list(keys),
                                              "first": first, "tenant": tenant, "request": request})
                slots = reply.get("slots")
                tiers = reply.get("tiers")
                if not isinstance(slots, list) or not isinstance(tiers, list) or len(slots) > len(keys) \
                        or len(tiers) != len(slots):
                    self._break(conn)
                    raise DaemonUnavailable("the daemon's acquire reply is malformed")
                if not slots:
                    return None
                if reply.get("lease") != lease_id:
                    self._break(conn)
                    raise DaemonUnavailable("the daemon's acquire reply names another lease")
                try:
                    views = [conn.arena.view(s, layout.chunk_bytes) for s in slots]
                except DaemonUnavailable:
                    self._break(conn)  # its pins end with the connection
                    raise
                conn.arena.refs += 1
                return ReadLease(lease_id, list(keys[: len(slots)]), views, [str(t) for t in tiers], conn)
        except DaemonUnavailable as exc:
            self._failed("acquire", exc)
            return None

    def release(self, lease: ReadLease, *, took: Sequence[int] | None = None, had: int = 0,
                failed: int = 0) -> bool:
        """End a read lease; True if what was read through it can be trusted (the daemon held
        the pins the whole time). ``took``: tokens the engine used of each chunk (default: all),
        ``had``: tokens it already held itself, ``failed``: chunks it could not copy -- for the
        daemon's statistics."""
        if lease.ended:
            raise ValueError(f"lease {lease.id} is already ended")
        lease.ended = True
        with self._lock:
            lease._conn.arena.release()
            c = self.layout.chunk_tokens if self.layout else 0
            report = [c] * len(lease.keys) if took is None else [int(t) for t in took]
            try:
                self._leased(lease._conn, "release", lease=lease.id, took=report, had=int(had),
                             failed=int(failed))
                return True
            except LeaseLost as exc:
                self.lost_leases += 1
                log.warning("kvtier: read lease %d was lost (%s); its chunks are treated as misses", lease.id, exc)
                return False
            except DaemonUnavailable as exc:
                self.lost_leases += 1
                self._failed("release", exc)
                return False

    def reserve(self, keys: Sequence[ChunkKey], *, first: int = 0, tenant: str | None = None,
                request: str | None = None) -> WriteLease | None:
        """DRAM slots for new chunks ``keys`` (chunks ``first...`` of their sequence), in order;
        shorter than ``keys`` when DRAM has no room. None if the daemon is unavailable. Fill the
        views, then :meth:`commit` (or :meth:`abandon`) the lease."""
        layout = self._need_layout()
        if not keys:
            return None
        lease_id = next(self._leases)
        try:
            with self._lock:
                conn = self._connect()
                reply = self._exchange(conn, {"op": "reserve", "lease": lease_id, "keys": list(keys),
                                              "first": first, "tenant": tenant, "request": request})
                slots = reply.get("slots")
                if not isinstance(slots, list) or len(slots) > len(keys):
                    self._break(conn)
                    raise DaemonUnavailable("the daemon's reserve reply is malformed")
                granted = reply.get("lease")
                if granted not in (None, lease_id) or (granted is None) != all(s in (HELD, BUSY) for s in slots):
                    self._break(conn)
                    raise DaemonUnavailable("the daemon's reserve reply names another lease")
                try:
                    views = [None if s in (HELD, BUSY) else conn.arena.view(s, layout.chunk_bytes) for s in slots]
                except DaemonUnavailable:
                    self._break(conn)  # its reservations are orphaned; we never wrote them
                    self._forget.setdefault(conn.epoch, []).append(lease_id)
                    raise
                if granted is not None:
                    conn.arena.refs += 1
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
        with self._lock:
            conn = lease._conn
            conn.arena.release()
            try:
                reply = self._leased(conn, "commit", lease=lease.id, written=list(written), success=ok)
                return int(reply.get("committed", 0))  # type: ignore[call-overload]
            except DaemonUnavailable as exc:
                # Lost: the daemon keeps its slots reserved until told nothing writes them.
                self.lost_leases += 1
                self._forget.setdefault(conn.epoch, []).append(lease.id)
                if not isinstance(exc, LeaseLost):
                    self._failed("commit", exc)
                return 0

    def abandon(self, lease: WriteLease) -> None:
        self.commit(lease, [], ok=False)

    # -- the store API --------------------------------------------------------------------------
    def lookup(self, tokens: object, *, tenant: str | None = None, request: str | None = None) -> LookupResult:
        layout = self._need_layout()
        chunks = chunk_tokens_of(tokens, self.namespace(), layout.chunk_tokens)
        try:
            _, reply = self._call("lookup", keys=chunks.keys, num_tokens=chunks.num_tokens, tenant=tenant,
                                  request=request)
            tiers = reply.get("tiers")
            if not isinstance(tiers, list) or len(tiers) > len(chunks.keys):
                raise DaemonUnavailable("the daemon's lookup reply is malformed")
        except DaemonUnavailable as exc:
            self._failed("lookup", exc)
            return LookupResult(num_tokens=chunks.num_tokens, hit_tokens=0, keys=[], tiers=[])
        c = layout.chunk_tokens
        return LookupResult(chunks.num_tokens, len(tiers) * c, chunks.keys[: len(tiers)], [str(t) for t in tiers])

    def load(self, hit: LookupResult, out: Sequence[LayerKV], *, layers: Sequence[int] | None = None,
             promote: bool = True, tenant: str | None = None, request: str | None = None) -> LoadResult:
        """Copy the hit's chunks from the shared arena into ``out`` (fewer tokens on failure).

        Chunks are pinned in rounds of what DRAM can hold at once (the daemon promotes chunks
        from SSD into free slots), copied, and released; a round whose lease turns out lost
        is not counted (``promote`` is accepted for the store's signature; the daemon always
        serves from DRAM)."""
        layout = self._need_layout()
        wanted = list(range(layout.num_layers)) if layers is None else list(layers)
        done = 0
        tiers: list[str] = []
        while done < len(hit.keys):
            lease = self.acquire(hit.keys[done:], first=done, tenant=tenant, request=request)
            if lease is None:
                break
            try:
                for j, view in enumerate(lease.views):
                    for layer in wanted:
                        lo = layout.layer_offset(layer)
                        unpack_layer(view[lo : lo + layout.layer_bytes], out[layer], done + j, layout)
            except BaseException:
                self.release(lease, took=[0] * len(lease.keys), failed=len(lease.keys))
                raise
            if not self.release(lease):
                break  # what this round copied may be another chunk's bytes: not used
            tiers.extend(lease.tiers)
            done += len(lease.views)
        tokens = done * layout.chunk_tokens
        return LoadResult(tokens=tokens, kv=[tuple(t[:, :tokens] for t in pair) for pair in out], tiers=tiers)

    def save(self, tokens: object, kv: Sequence[Sequence[torch.Tensor]], *, tenant: str | None = None,
             request: str | None = None) -> SaveResult:
        """Write the full chunks the daemon does not hold yet straight into the arena.

        Slots are reserved in rounds: once a round is committed its chunks can be demoted to
        make room for the next, as with a local store."""
        layout = self._need_layout()
        layers, kv_tokens = check_kv(kv, layout)
        keys = self.keys_for(tokens)[: kv_tokens // layout.chunk_tokens]
        stored = present = busy = done = 0
        while done < len(keys):
            lease = self.reserve(keys[done:], first=done, tenant=tenant, request=request)
            if lease is None:
                break  # no room at all (every resident chunk pinned), or the daemon is away
            present += sum(lease.held)
            busy += sum(1 for v, h in zip(lease.views, lease.held, strict=True) if v is None and not h)
            written: list[int] = []
            try:
                for i, view in enumerate(lease.views):
                    if view is not None:
                        pack_chunk(view, layers, done + i, layout)
                        written.append(i)
            finally:
                stored += self.commit(lease, written)
            done += len(lease.views)
        return SaveResult(stored=stored, present=present, dropped=len(keys) - done, busy=busy)

    def prefetch(self, keys: Sequence[ChunkKey], wait: bool = False, *, first: int = 0,
                 tenant: str | None = None) -> int:
        """Ask the daemon to bring the held prefix of ``keys`` into DRAM (in the background, or
        before replying with ``wait``); how many it promoted (0 when not waited for)."""
        try:
            _, reply = self._call("prefetch", keys=list(keys), first=first, wait=wait, tenant=tenant)
            return int(reply.get("promoted", 0))  # type: ignore[call-overload]
        except DaemonUnavailable as exc:
            self._failed("prefetch", exc)
            return 0

    def queued(self, request_id: str, keys: Sequence[ChunkKey], *, wait: bool = False,
               tenant: str | None = None) -> int:
        """A request waits to be served: the daemon's policies hear of it and its held chunks
        are prefetched into DRAM (:meth:`kvtier.cache.ChunkCache.queued`). 0 if unavailable."""
        try:
            _, reply = self._call("queued", request_id=request_id, keys=list(keys), wait=wait, tenant=tenant)
            return int(reply.get("promoted", 0))  # type: ignore[call-overload]
        except DaemonUnavailable as exc:
            self._failed("queued", exc)
            return 0

    def started(self, request_id: str) -> None:
        """The request is being served: its lookups, loads and saves (``request=``) are one use
        of each chunk for the daemon's policies."""
        try:
            self._call("started", request_id=request_id)
        except DaemonUnavailable as exc:
            self._failed("started", exc)

    def finished(self, request_id: str) -> None:
        try:
            self._call("finished", request_id=request_id)
        except DaemonUnavailable as exc:
            self._failed("finished", exc)

    def stats(self) -> dict[str, object]:
        """The daemon's snapshot; raises DaemonUnavailable (for ``kvtier store stats``)."""
        return self._call("stats")[1]["stats"]  # type: ignore[return-value]

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the daemon's background work (write-through copies, prefetches, uploads)
        is done; False on timeout or if the daemon is unavailable."""
        try:
            return bool(self._call("flush", timeout_s=int(timeout))[1].get("done"))
        except DaemonUnavailable as exc:
            self._failed("flush", exc)
            return False

    def close(self) -> None:
        """Close the connection (open leases are lost) and unmap the arena once no lease on it
        is open."""
        with self._lock:
            if self._conn is not None:
                self._break(self._conn)
            if self._arena is not None:
                self._arena.retire()
                self._arena = None
