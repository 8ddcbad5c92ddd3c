"""``kvtier store serve``: one KVStore shared by many processes on one machine.

The daemon owns the chunk index, the policy, the DRAM tier (its arena in POSIX shared memory)
and the SSD tier. Clients connect over a Unix socket for control -- lookup, acquire (pin for
reading), release, reserve (a slot to write), commit, prefetch, stats -- and move chunk bytes
themselves, in place, in the shared arena.

Leases: everything a client pins or reserves belongs to its connection. When the connection
ends -- the client closed it, crashed or was killed -- its pins are released and its unfinished
writes are abandoned, so a dead client leaves nothing pinned and nothing half-written.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import socket
import socketserver
import threading
import time
from collections import Counter
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey
from kvtier.server import protocol
from kvtier.server.metrics import Metrics
from kvtier.store import KVStore, StoreConfig
from kvtier.tiers.base import Reservation, TierFullError, check_key
from kvtier.tiers.host import SHM_DIR

log = logging.getLogger(__name__)

SHM_PREFIX = "kvtier-"


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: str
    store: StoreConfig
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1:PORT (0: any free port; None: off)."""

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise ValueError("socket_path must not be empty")
        parent = os.path.dirname(os.path.abspath(self.socket_path))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"cannot create the socket {self.socket_path}: {parent} is not a writable directory")
        if len(os.fsencode(self.socket_path)) > 100:
            raise ValueError(f"socket path {self.socket_path!r} is too long for a Unix socket")


class _Session:
    """What one client connection holds: released when it ends."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pins: Counter[ChunkKey] = Counter()
        self.writes: dict[ChunkKey, Reservation] = {}


def _remove_stale_arenas() -> None:
    """Arenas of daemons that died without cleaning up (kill -9) are named by their pid."""
    for path in glob.glob(os.path.join(SHM_DIR, SHM_PREFIX + "*")):
        pid = path.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(path)
                log.info("removed the arena of a dead daemon: %s", path)
            except OSError:
                pass


class StoreDaemon:
    """Serves one KVStore over a Unix socket. ``start()`` runs it in a thread; ``serve_forever``
    in the caller's."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        _remove_stale_arenas()
        shm_name = f"{SHM_PREFIX}{os.getpid()}"
        store_cfg = dataclasses.replace(
            config.store, host=dataclasses.replace(config.store.host, shm_name=shm_name)
        )
        self._claim_socket(config.socket_path)
        self.store = KVStore(store_cfg)
        self._sessions: set[_Session] = set()
        self._lock = threading.Lock()
        self.metrics = Metrics(self)
        daemon = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                daemon._serve_connection(self.request)

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self._server = Server(config.socket_path, Handler)
        os.chmod(config.socket_path, 0o600)
        self._thread: threading.Thread | None = None
        self.metrics_address: tuple[str, int] | None = None
        if config.metrics_port is not None:
            self.metrics_address = self.metrics.serve("127.0.0.1", config.metrics_port)

    @staticmethod
    def _claim_socket(path: str) -> None:
        if not os.path.exists(path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # left by a daemon that died
            return
        finally:
            probe.close()
        raise ValueError(f"another daemon is serving {path}")

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> StoreDaemon:
        self._thread = threading.Thread(target=self.serve_forever, name="kvtier-daemon", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        log.info("kvtier store daemon serving %s", self.config.socket_path)
        self._server.serve_forever(poll_interval=0.2)

    def stop(self) -> None:
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
        self.metrics.close()
        try:
            os.unlink(self.config.socket_path)
        except FileNotFoundError:
            pass
        self.store.close()

    # -- connections --------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket) -> None:
        session = _Session(sock)
        with self._lock:
            self._sessions.add(session)
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
                op = str(request.get("op"))
                try:
                    reply = self._dispatch(op, request, session)
                except (ValueError, TypeError, KeyError) as exc:
                    reply = {"ok": False, "error": f"{op}: {exc}"}
                self.metrics.observe(op, time.perf_counter() - start)
                try:
                    protocol.send(sock, reply)
                except OSError:
                    return
        finally:
            self._end_session(session)

    def _end_session(self, session: _Session) -> None:
        """The lease ends with the connection: release pins, abandon unfinished writes."""
        store = self.store
        for key, count in session.pins.items():
            for _ in range(count):
                store.release([key])
        for res in session.writes.values():
            store.commit_chunk(res, ok=False)
        if session.pins or session.writes:
            log.info("client gone: released %d pins, abandoned %d writes",
                     sum(session.pins.values()), len(session.writes))
        with self._lock:
            self._sessions.discard(session)

    # -- operations ---------------------------------------------------------------------------
    def _dispatch(self, op: str, req: dict[str, object], session: _Session) -> dict[str, object]:
        store = self.store
        if op == "hello":
            host = store.host
            return {
                "ok": True, "version": protocol.VERSION, "model": store.config.model,
                "layout": dataclasses.asdict(store.layout), "shm_name": host.arena.shm_name,
                "arena_bytes": host.arena.size, "slot_stride": host.slot_stride,
            }
        if op == "stats":
            return {"ok": True, "stats": self.snapshot()}
        keys = [check_key(k) for k in req.get("keys", [])]  # type: ignore[union-attr]
        if op == "lookup":
            hit = store.lookup_keys(keys, int(req.get("num_tokens") or len(keys) * store.layout.chunk_tokens))
            return {"ok": True, "tiers": hit.tiers}
        if op == "acquire":
            slots = store.acquire(keys)
            session.pins.update(keys[: len(slots)])
            return {"ok": True, "slots": slots}
        if op == "release":
            for key in keys:
                if session.pins[key] <= 0:
                    raise ValueError(f"chunk {key.hex()} is not pinned by this client")
                session.pins[key] -= 1
                if not session.pins[key]:
                    del session.pins[key]
                store.release([key])
            return {"ok": True}
        if op == "reserve":
            slots: list[int] = []
            for key in keys:
                try:
                    res = store.reserve_chunk(key)
                except TierFullError:
                    break
                if res is None:
                    slots.append(-1)  # already held: nothing to write
                    continue
                session.writes[key] = res
                slots.append(int(res.slot))  # type: ignore[call-overload]
            return {"ok": True, "slots": slots}
        if op == "commit":
            ok = bool(req.get("success", True))
            done = 0
            for key in keys:
                res = session.writes.pop(key, None)
                if res is None:
                    raise ValueError(f"chunk {key.hex()} has no open write from this client")
                done += store.commit_chunk(res, ok=ok)
            return {"ok": True, "committed": done}
        if op == "prefetch":
            return {"ok": True, "promoted": store.prefetch(keys)}
        if op == "queued":
            return {"ok": True, "promoted": store.queued(str(req["request_id"]), keys)}
        if op == "started":
            store.started(str(req["request_id"]))
            return {"ok": True}
        raise ValueError(f"unknown operation {op!r}")

    def snapshot(self) -> dict[str, object]:
        snap = self.store.snapshot()
        with self._lock:
            sessions = list(self._sessions)
        snap["clients"] = len(sessions)
        snap["pinned_chunks"] = sum(sum(s.pins.values()) for s in sessions)
        snap["writes_in_flight"] = sum(len(s.writes) for s in sessions)
        return snap
