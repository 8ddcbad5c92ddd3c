"""The Valkey client of :mod:`kvtier.tiers.valkey`, with the timeouts and reconnection the remote
tiers promise."""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import valkey
from valkey.cluster import ClusterNode, ValkeyCluster
from valkey.exceptions import ClusterDownError, ResponseError, TryAgainError, ValkeyError
from valkey.exceptions import ConnectionError as ValkeyConnectionError

from kvtier.errors import KVTierError
from kvtier.tiers.base import TierStats
from kvtier.tiers.remote_config import ValkeyTierConfig, parse_address
from kvtier.tiers.remote_health import Health

log = logging.getLogger(__name__)

Client = valkey.Valkey | ValkeyCluster
T = TypeVar("T")


class Unavailable(KVTierError):
    """The call did not reach a server answer (already counted and logged)."""


def bulks(*args: bytes | str | int) -> bytes:
    """Arguments in the Valkey protocol (RESP2 bulk strings); a command is ``b"*<count>\\r\\n"``
    and the bulks of all its arguments. Quicker than valkey-py's packer for the many short
    arguments of a script call on a hot path, and a fixed head can be packed once."""
    out = []
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(out)


IOV_MAX = 512
"""Buffers handed to one ``sendmsg`` at most (Linux refuses more than 1024)."""


def _send(conn: valkey.connection.Connection, parts: list[bytes | memoryview]) -> None:
    """Write ``parts`` in one ``sendmsg`` where the socket allows (a small command written on
    its own right after a big upload waits on loopback: ~0.15 ms a put); TLS: one by one."""
    sock = conn._sock  # valkey-py (pinned) sends its packed commands through this socket too
    if sock is None:
        raise ValkeyConnectionError("connection closed")
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    while views:
        n = sock.sendmsg(views[:IOV_MAX])
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0], n = views[0][n:], 0


@dataclass(slots=True)
class Upload:
    """A big command ``first`` (its memoryview argument goes out without being copied, ``piece``
    bytes at a time, or all at once without ``piece``), then the command ``then()`` packs
    (:func:`bulks`), written while the server takes the first. ``sent(part)`` runs after each
    part leaves (it reads bytes still in this core's cache while the server takes them), except
    the last, which it sees before it leaves together with the second command."""

    first: tuple[object, ...]
    then: Callable[[], bytes]
    piece: int = 0
    sent: Callable[[memoryview], None] | None = None


def overlapped(client: valkey.Valkey, uploads: list[Upload]) -> list[tuple[object, object]]:
    """Send ``uploads`` one after the other on one connection (the server works on one while the
    next goes out), then read the two replies of each, a server error as its exception object.
    The commands are packed here, not by valkey-py, whose C packer (with libvalkey) copies
    buffers. Standalone clients only; a broken connection is dropped, not reused."""
    pool = client.connection_pool
    conn = pool.get_connection("SET")
    try:
        conn.check_health()  # before the first byte: nothing may come between a command's parts
        pending: list[bytes | memoryview] = []
        for up in uploads:
            head = b"*%d\r\n" % len(up.first)
            for arg in up.first:
                if not isinstance(arg, memoryview):
                    head += bulks(arg)  # type: ignore[arg-type]
                    continue
                arg = arg.cast("B") if arg.format != "B" or arg.ndim != 1 else arg
                pending.append(head + b"$%d\r\n" % len(arg))
                step = up.piece or len(arg)
                pieces = [arg[at : at + step] for at in range(0, len(arg), step)]
                for part in pieces[:-1]:
                    _send(conn, [*pending, part])
                    pending = []
                    if up.sent is not None:
                        up.sent(part)
                if up.sent is not None:  # the last piece leaves with what follows, in one system call
                    up.sent(pieces[-1])
                pending.append(pieces[-1])
                head = b"\r\n"
            pending.append(head + up.then())
        _send(conn, pending)
        replies: list[object] = []
        for _ in range(2 * len(uploads)):
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return [(replies[i], replies[i + 1]) for i in range(0, len(replies), 2)]
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


class ValkeyConnection:
    """A valkey-py client (standalone or cluster) made on first use and again after failures.

    Every socket operation waits at most ``timeout_s`` and valkey-py's own retries are off, so a
    call fails within about one timeout; a cluster client that loses a node refreshes its slot
    map once, which can add one connect timeout per node it asks.
    Health is per tier, not per cluster node: after one node fails, calls fail fast for
    ``reconnect_interval_s``, also those for the other nodes.
    """

    def __init__(self, config: ValkeyTierConfig, stats: TierStats) -> None:
        self.config = config
        self.health = Health(f"valkey {','.join(config.addresses)}", config.reconnect_interval_s, stats)
        self._client: Client | None = None
        self._lock = threading.Lock()

    def _connect(self) -> Client:
        c = self.config
        common = {"username": c.username, "password": c.password, "socket_timeout": c.timeout_s,
                  "socket_connect_timeout": c.timeout_s, "ssl": c.ssl, "ssl_ca_certs": c.ssl_ca_file,
                  "ssl_certfile": c.ssl_cert_file, "ssl_keyfile": c.ssl_key_file}
        if c.cluster:
            nodes = [ClusterNode(*parse_address(a, "addresses")) for a in c.addresses]
            return ValkeyCluster(startup_nodes=nodes, cluster_error_retry_attempts=1, **common)
        host, port = parse_address(c.addresses[0], "addresses")
        return valkey.Valkey(host=host, port=port, **common)

    @property
    def client(self) -> Client | None:
        """The client if one was made (for tests that ask where a key lives)."""
        return self._client

    def run(self, what: str, fn: Callable[[Client], T]) -> T:
        """``fn(client)``, or raise Unavailable (tier down, or this call failed; counted, logged)."""
        if not self.health.ready():
            raise Unavailable(what)
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
                client = self._client
            result = fn(client)
        except (ClusterDownError, TryAgainError) as exc:  # a cluster that is reconfiguring
            self.health.failed(what, exc)
            raise Unavailable(what) from exc
        except ResponseError as exc:  # the server answered: an error of this call only (OOM...)
            self.health.refused(what, exc)
            raise Unavailable(what) from exc
        except (ValkeyError, OSError) as exc:  # unreachable, timed out, refused credentials
            self.health.failed(what, exc)
            raise Unavailable(what) from exc
        self.health.succeeded()
        return result

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection
                log.debug("valkey: close: %s", exc)
