"""The client's link to the store daemon: one connection at a time, its hello, its arena.

A connection that breaks or times out is never used again (the reply stream is unknown), and
every lease on it is lost. A request that holds nothing may be sent again once on a new
connection; a request about a lease only ever goes on the lease's own connection. The arena of
a daemon that went away stays mapped until the last lease on it has ended. Leases lost with
a connection whose caller has since ended them are named to the daemon (``forget``) on the next
connection to the same daemon instance, so it can free their slots.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.errors import DaemonUnavailable, LeaseLost
from kvtier.server import protocol
from kvtier.server.runtime import ARENA_NAME, check_socket_dir, peer_of
from kvtier.tiers.arena import PAGE, SHM_DIR, HostArena

log = logging.getLogger(__name__)

MAX_ARENA = 1 << 46


class Arena:
    """A daemon's arena mapped here, unmapped only once it is retired (its daemon is gone or
    the client closes) and no lease on it is open."""

    def __init__(self, name: str, size: int, owner_uid: int, pin: bool = False) -> None:
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
        if pin:
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

    def pin(self) -> None:
        self.arena.pin()

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
class Connection:
    sock: socket.socket
    epoch: bytes
    arena: Arena | None
    """None for a client that maps no arena (it only asks questions)."""
    tiers: list[str]
    broken: bool = False

    def mapped(self) -> Arena:
        if self.arena is None:
            raise ValueError("this StoreClient maps no arena (map_arena=False): it cannot read or write chunks")
        return self.arena


class Link:
    """One connection to the daemon at a time (thread-safe: requests are serialized)."""

    def __init__(self, socket_path: str, hello: Callable[[], dict[str, object]], timeout_s: float,
                 retry_s: float, *, daemon_uid: int | None = None, map_arena: bool = True,
                 check_dir: bool = False) -> None:
        self.socket_path = socket_path
        self.daemon_uid = daemon_uid
        """The uid a daemon may run as besides this process's own (None: only our own)."""
        self.map_arena = map_arena
        self.pin_arena = False
        self.check_dir = check_dir
        """Check the socket's directory (the default path: it must be this user's own)."""
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._hello = hello
        self.lock = threading.RLock()
        self._conn: Connection | None = None
        self._arena: Arena | None = None
        self._next_try = 0.0
        self.down_logged = False
        self._refused: str | None = None
        self._forget: dict[bytes, list[int]] = {}
        self.lost_chunks = 0
        """Chunks read under leases lost since the daemon last heard (reported with forget)."""
        self.tier_names: list[str] = ["host"]
        self.round_trips = 0
        """Requests sent and answered (or failed) on this link, and their seconds in all."""
        self.round_trip_s = 0.0

    def set_pin(self, pin: bool) -> None:
        """Page-lock arenas mapped from now on (and the one mapped now) when ``pin``."""
        self.pin_arena = pin
        if pin and self._arena is not None:
            self._arena.pin()

    def forget_later(self, conn: Connection, lease_id: int) -> None:
        """A lease lost with ``conn``, now ended by its caller: tell the daemon that granted it."""
        self._forget.setdefault(conn.epoch, []).append(lease_id)

    def connect(self) -> Connection:
        """The live connection, or a new one (after ``retry_s`` since the last failure). Lost
        leases ended since the last request are named to the daemon first."""
        if self._conn is not None and not self._conn.broken and (self._forget or self.lost_chunks):
            self._send_forgets(self._conn)  # may drop it: then a new one below
        if self._conn is not None and not self._conn.broken:
            return self._conn
        now = time.monotonic()
        if now < self._next_try:
            raise DaemonUnavailable(self._refused or "daemon unreachable; retrying later")
        self._next_try = now + self.retry_s
        if self.check_dir:
            try:
                check_socket_dir(self.socket_path)
            except ValueError as exc:
                self._refused = str(exc)
                if not self.down_logged:
                    log.error("kvtier: %s; serving as cache misses", exc)
                raise DaemonUnavailable(str(exc)) from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
            daemon = peer_of(sock)
            if daemon.uid not in (os.geteuid(), self.daemon_uid):
                sock.close()
                self._refused = (f"the process serving {self.socket_path} runs as uid {daemon.uid}, neither "
                                 f"this user ({os.geteuid()}) nor the daemon_uid configured "
                                 f"({self.daemon_uid}): not trusted with any KV")
                if not self.down_logged:
                    log.error("kvtier: %s; serving as cache misses", self._refused)
                raise DaemonUnavailable(self._refused)
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
        if self.down_logged:
            log.warning("kvtier daemon at %s is back", self.socket_path)
            self.down_logged = False
        self._send_forgets(conn)
        return conn

    def _attach(self, sock: socket.socket, hello: dict[str, object] | None, daemon_uid: int) -> Connection:
        if hello is None:
            raise DaemonUnavailable("the daemon closed the connection at hello")
        if not hello.get("ok"):
            error = str(hello.get("error"))[:500]
            if hello.get("refused"):
                self._refused = f"the daemon refused this client: {error}"
                if not self.down_logged:
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
        if not self.map_arena:
            return Connection(sock, epoch, None, self.tier_names)
        arena = self._arena
        if arena is None or arena.name != name or arena.size != size:
            arena = Arena(name, size, daemon_uid, pin=self.pin_arena)  # type: ignore[arg-type]
            if self._arena is not None:
                self._arena.retire()  # the old daemon's: unmapped once its last lease ends
            self._arena = arena
        return Connection(sock, epoch, arena, self.tier_names)

    def _send_forgets(self, conn: Connection) -> None:
        """Name the lost write leases the caller has ended (their slots can be freed), and how
        many chunks were read under lost read leases (thrown away: load failures)."""
        ids = self._forget.pop(conn.epoch, None)
        self._forget.clear()  # leases of other daemon instances died with them
        lost, self.lost_chunks = self.lost_chunks, 0
        if ids or lost:
            try:
                self.exchange(conn, {"op": "forget", "leases": ids or [], "lost_chunks": lost})
            except DaemonUnavailable:
                self.lost_chunks += lost
                if ids:
                    self._forget.setdefault(conn.epoch, []).extend(ids)

    def drop(self, conn: Connection) -> None:
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

    def exchange(self, conn: Connection, message: dict[str, object],
                 timeout: float | None = None) -> dict[str, object]:
        """One request and its reply; ``timeout``: this call's own limit (default ``timeout_s``:
        an operation that is meant to take long, a flush, says so instead of timing out)."""
        t0 = time.perf_counter()
        try:
            conn.sock.settimeout(timeout if timeout is not None else self.timeout_s)
            protocol.send(conn.sock, message)
            reply = protocol.recv(conn.sock)
        except (OSError, protocol.ProtocolError) as exc:
            self._count(t0)
            self.drop(conn)
            raise DaemonUnavailable(str(exc) or type(exc).__name__) from exc
        self._count(t0)
        if reply is None:
            self.drop(conn)
            raise DaemonUnavailable("the daemon closed the connection")
        if not reply.get("ok"):
            if reply.get("lost"):
                raise LeaseLost(str(reply.get("error")))
            raise DaemonUnavailable(str(reply.get("error"))[:500])
        return reply

    def _count(self, t0: float) -> None:
        self.round_trips += 1  # (under ``lock``: requests are serialized)
        self.round_trip_s += time.perf_counter() - t0

    def call(self, op: str, timeout: float | None = None, **fields: object) -> tuple[Connection, dict[str, object]]:
        """A request that holds nothing: tried once more on a new connection if the one it
        went out on had been up before (the daemon may have restarted since)."""
        with self.lock:
            for attempt in (0, 1):
                had = self._conn is not None and not self._conn.broken
                conn = self.connect()
                try:
                    return conn, self.exchange(conn, {"op": op, **fields}, timeout)
                except LeaseLost:
                    raise
                except DaemonUnavailable:
                    if attempt or not had or not conn.broken:
                        raise
                    self._next_try = 0.0
            raise DaemonUnavailable("unreachable")  # pragma: no cover - the loop returns or raises

    def leased(self, conn: Connection | None, op: str, **fields: object) -> dict[str, object]:
        """A request about a lease: only ever on the lease's own connection."""
        with self.lock:
            if conn is None or conn.broken or conn is not self._conn:
                raise LeaseLost(f"{op}: the connection that held the lease is gone")
            return self.exchange(conn, {"op": op, **fields})


    def close(self) -> None:
        """Close the connection (open leases are lost) and unmap the arena once no lease on it
        is open."""
        with self.lock:
            if self._conn is not None:
                self.drop(self._conn)
            if self._arena is not None:
                self._arena.retire()
                self._arena = None
