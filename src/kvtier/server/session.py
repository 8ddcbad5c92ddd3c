"""What the daemon's operations (:mod:`kvtier.server.ops`) are handed: a client's
:class:`Session`, and the daemon as :class:`OpsDaemon` -- the part of
:class:`~kvtier.server.daemon.StoreDaemon` they use. Both the daemon and its operations import
this module; neither imports the other.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Protocol

from kvtier.core.keys import ChunkKey, Namespace
from kvtier.server.leases import Lease, Leases
from kvtier.server.request_loads import RequestLoads
from kvtier.server.runtime import Peer, ProcessWatch
from kvtier.server.settings import ClientNamespace, DaemonConfig

if TYPE_CHECKING:
    from kvtier.store.cache import ChunkCache


class Session:
    """One client connection and what it holds."""

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.watch = ProcessWatch(peer.pid)
        self.client = b""
        self.instance = ""
        self.ns: ClientNamespace | None = None
        self.leases: dict[int, Lease] = {}
        """Changed only by :class:`~kvtier.server.leases.Leases`, under its lock."""
        self._bound: dict[str, Namespace] = {}

    @property
    def owner(self) -> tuple[int, int]:
        """(pid, uid) at the other end: who may later say it stopped writing this one's leases."""
        return self.peer.pid, self.peer.uid

    def namespace(self, tenant: str) -> Namespace:
        ns = self._bound.get(tenant)
        if ns is None:
            assert self.ns is not None
            ns = self._bound[tenant] = self.ns.namespace(tenant)
        return ns


class OpsDaemon(Protocol):
    """What an operation uses of the daemon (:class:`~kvtier.server.daemon.StoreDaemon` is one)."""

    config: DaemonConfig
    epoch: bytes
    cache: ChunkCache | None
    leases: Leases
    request_loads: RequestLoads

    def namespace_of(self, session: Session) -> ClientNamespace: ...

    def bound(self, session: Session, req: dict[str, object]) -> tuple[ClientNamespace, list[ChunkKey], str]: ...

    def request_name(self, session: Session, request_id: str | None) -> str | None: ...

    def use_of(self, req: dict[str, object], session: Session, *, finished: bool = False,
               arrived: bool = False) -> int | None: ...

    def snapshot(self) -> dict[str, object]: ...
