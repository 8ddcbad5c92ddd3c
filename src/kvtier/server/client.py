"""Client of the store daemon: the KVStore API (lookup / load / save / prefetch) for processes
that share the daemon's DRAM arena.

Every failure to reach the daemon -- down at start, killed mid-run, restarting -- is a cache
miss: logged once per outage, counted in :attr:`StoreClient.errors`, never raised. The client
reconnects (at most once per ``retry_s``) and re-attaches the arena when the daemon returns.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.core.keys import ChunkKey, Namespace, chunk_tokens_of
from kvtier.core.layout import KVLayout
from kvtier.server import protocol
from kvtier.store import LoadResult, LookupResult, SaveResult
from kvtier.tiers.host import HostArena
from kvtier.transfer import LayerKV, check_kv, pack_chunk, unpack_layer

log = logging.getLogger(__name__)


class DaemonUnavailable(Exception):
    """The daemon cannot be reached now (internal: turned into misses)."""


@dataclass(frozen=True)
class _Attachment:
    layout: KVLayout
    namespace: Namespace
    arena: HostArena
    slot_stride: int


class StoreClient:
    """Thread-safe; one socket, requests serialized."""

    def __init__(self, socket_path: str, *, timeout_s: float = 5.0, retry_s: float = 1.0, tenant: str = "") -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.tenant = tenant
        self.errors = 0
        """Requests that failed because the daemon was unreachable or answered an error."""
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._att: _Attachment | None = None
        self._next_try = 0.0
        self._down_logged = False

    # -- connection ---------------------------------------------------------------------------
    def _connect(self) -> _Attachment:
        if self._sock is not None and self._att is not None:
            return self._att
        now = time.monotonic()
        if now < self._next_try:
            raise DaemonUnavailable("daemon unreachable; retrying later")
        self._next_try = now + self.retry_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
            protocol.send(sock, {"op": "hello"})
            hello = protocol.recv(sock)
        except (OSError, protocol.ProtocolError) as exc:
            sock.close()
            raise DaemonUnavailable(str(exc)) from exc
        if not hello or not hello.get("ok") or hello.get("version") != protocol.VERSION:
            sock.close()
            raise DaemonUnavailable(f"unexpected hello from the daemon: {hello!r}")
        layout = KVLayout(**hello["layout"])  # type: ignore[arg-type]
        old = self._att
        arena = HostArena.attach(str(hello["shm_name"]), int(hello["arena_bytes"]))  # type: ignore[call-overload]
        if torch.cuda.is_available():
            arena.pin()  # page-locked: device copies from the arena run at full speed
        if old is not None:
            old.arena.close()
        self._att = _Attachment(
            layout, Namespace(str(hello["model"]), layout.fingerprint, self.tenant), arena,
            int(hello["slot_stride"]),  # type: ignore[call-overload]
        )
        self._sock = sock
        if self._down_logged:
            log.warning("kvtier daemon at %s is back", self.socket_path)
            self._down_logged = False
        return self._att

    def _call(self, op: str, **fields: object) -> dict[str, object]:
        """One request. A connection that breaks is dropped and, if it had been up (the
        daemon may have restarted since), the request is tried once more on a new one."""
        with self._lock:
            for attempt in (0, 1):
                was_up = self._sock is not None
                if attempt:
                    self._next_try = 0.0
                self._connect()
                try:
                    protocol.send(self._sock, {"op": op, **fields})  # type: ignore[arg-type]
                    reply = protocol.recv(self._sock)  # type: ignore[arg-type]
                except (OSError, protocol.ProtocolError) as exc:
                    self._drop()
                    if attempt or not was_up:
                        raise DaemonUnavailable(str(exc)) from exc
                    continue
                if reply is None:
                    self._drop()
                    if attempt or not was_up:
                        raise DaemonUnavailable("the daemon closed the connection")
                    continue
                if not reply.get("ok"):
                    raise DaemonUnavailable(str(reply.get("error")))
                return reply
            raise DaemonUnavailable("unreachable")  # pragma: no cover - the loop returns or raises

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        if not self._down_logged:
            log.warning("kvtier daemon at %s: %s failed (%s); serving as cache misses", self.socket_path, what, exc)
            self._down_logged = True

    @property
    def model(self) -> str | None:
        """The daemon's model id, once connected."""
        with self._lock:
            try:
                return self._connect().namespace.model
            except DaemonUnavailable:
                return None

    @property
    def layout(self) -> KVLayout | None:
        """The daemon's layout, once connected."""
        with self._lock:
            try:
                return self._connect().layout
            except DaemonUnavailable:
                return None

    # -- the store API --------------------------------------------------------------------------
    # -- chunk slots, for engines that copy their own page layout (the vLLM connector) ---------
    def _views(self, att: _Attachment, slots: Sequence[int]) -> list[torch.Tensor]:
        n = att.layout.chunk_bytes
        return [att.arena.tensor[s * att.slot_stride : s * att.slot_stride + n] for s in slots]

    def acquire(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """Pin the longest held prefix of ``keys`` in DRAM; zero-copy byte views of their slots.
        Call :meth:`release` with ``keys[:len(views)]`` when done. [] if the daemon is down."""
        try:
            with self._lock:
                slots = list(self._call("acquire", keys=list(keys))["slots"])  # type: ignore[call-overload]
                # the arena of the daemon that answered (a restart re-attaches inside _call)
                return self._views(self._att, slots)  # type: ignore[arg-type]
        except DaemonUnavailable as exc:
            self._failed("acquire", exc)
            return []

    def release(self, keys: Sequence[ChunkKey]) -> None:
        if not keys:
            return
        try:
            self._call("release", keys=list(keys))
        except DaemonUnavailable as exc:
            self._failed("release", exc)

    def reserve(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor | None]:
        """Slots to write new chunks into, in order (None: already held, nothing to write);
        shorter than ``keys`` when DRAM has no room. :meth:`commit` the written keys after."""
        try:
            with self._lock:
                slots = list(self._call("reserve", keys=list(keys))["slots"])  # type: ignore[call-overload]
                att = self._att
        except DaemonUnavailable as exc:
            self._failed("reserve", exc)
            return []
        views = self._views(att, [max(s, 0) for s in slots])  # type: ignore[arg-type]
        return [v if s >= 0 else None for v, s in zip(views, slots)]

    def commit(self, keys: Sequence[ChunkKey], ok: bool = True) -> int:
        if not keys:
            return 0
        try:
            return int(self._call("commit", keys=list(keys), success=ok)["committed"])  # type: ignore[call-overload]
        except DaemonUnavailable as exc:
            self._failed("commit", exc)
            return 0

    def keys_for(self, tokens: object) -> list[ChunkKey]:
        att = self._connect()
        return chunk_tokens_of(tokens, att.namespace, att.layout.chunk_tokens).keys

    def lookup(self, tokens: object) -> LookupResult:
        try:
            with self._lock:
                att = self._connect()
                chunks = chunk_tokens_of(tokens, att.namespace, att.layout.chunk_tokens)
                reply = self._call("lookup", keys=chunks.keys, num_tokens=chunks.num_tokens)
        except DaemonUnavailable as exc:
            self._failed("lookup", exc)
            return LookupResult(num_tokens=0, hit_tokens=0, keys=[], tiers=[])
        tiers = list(reply["tiers"])  # type: ignore[call-overload]
        c = att.layout.chunk_tokens
        return LookupResult(chunks.num_tokens, len(tiers) * c, chunks.keys[: len(tiers)], tiers)

    def load(self, hit: LookupResult, out: Sequence[LayerKV], layers: Sequence[int] | None = None) -> LoadResult:
        """Copy the hit's chunks from the shared arena into ``out`` (fewer tokens on failure).

        Chunks are pinned in rounds of what DRAM can hold at once (the daemon promotes chunks
        from SSD into free slots), copied, and released."""
        layout: KVLayout | None = None
        done = 0
        try:
            while done < len(hit.keys):
                with self._lock:
                    slots = list(self._call("acquire", keys=hit.keys[done:])["slots"])  # type: ignore[call-overload]
                    att = self._att  # the arena of the daemon that answered
                assert att is not None
                layout = att.layout
                if not slots:
                    break
                wanted = range(layout.num_layers) if layers is None else layers
                try:
                    for j, slot in enumerate(slots):
                        base = slot * att.slot_stride
                        raw = att.arena.tensor[base : base + layout.chunk_bytes]
                        for layer in wanted:
                            lo = layout.layer_offset(layer)
                            unpack_layer(raw[lo : lo + layout.layer_bytes], out[layer], done + j, layout)
                finally:
                    self._call("release", keys=hit.keys[done : done + len(slots)])
                done += len(slots)
        except DaemonUnavailable as exc:
            self._failed("load", exc)
        tokens = done * (layout.chunk_tokens if layout else 0)
        return LoadResult(tokens=tokens, kv=[tuple(t[:, :tokens] for t in pair) for pair in out],
                          tiers=["host"] * done)

    def save(self, tokens: object, kv: Sequence[Sequence[torch.Tensor]]) -> SaveResult:
        """Write the full chunks the daemon does not hold yet straight into the arena.

        Slots are reserved in rounds: once a round is committed its chunks can be demoted to
        make room for the next, as with a local store."""
        try:
            with self._lock:
                att = self._connect()
        except DaemonUnavailable as exc:
            self._failed("save", exc)
            return SaveResult(stored=0, present=0, dropped=0)
        layout = att.layout
        layers, kv_tokens = check_kv(kv, layout)
        keys = chunk_tokens_of(tokens, att.namespace, layout.chunk_tokens).keys
        keys = keys[: kv_tokens // layout.chunk_tokens]
        stored = present = done = 0
        try:
            while done < len(keys):
                slots = list(self._call("reserve", keys=keys[done:])["slots"])  # type: ignore[call-overload]
                if self._att is not att:  # the daemon restarted: its namespace may differ
                    raise DaemonUnavailable("the daemon restarted during a save")
                if not slots:
                    break  # no room at all: every resident chunk is pinned
                pending = [(done + i, s) for i, s in enumerate(slots) if s >= 0]
                present += len(slots) - len(pending)
                ok = False
                try:
                    for i, slot in pending:
                        base = slot * att.slot_stride
                        pack_chunk(att.arena.tensor[base : base + layout.chunk_bytes], layers, i, layout)
                    ok = True
                finally:
                    if pending:
                        reply = self._call("commit", keys=[keys[i] for i, _ in pending], success=ok)
                        stored += int(reply["committed"])  # type: ignore[call-overload]
                done += len(slots)
        except DaemonUnavailable as exc:
            self._failed("save", exc)
        return SaveResult(stored=stored, present=present, dropped=len(keys) - done)

    def prefetch(self, keys: Sequence[ChunkKey]) -> int:
        try:
            return int(self._call("prefetch", keys=list(keys))["promoted"])  # type: ignore[call-overload]
        except DaemonUnavailable as exc:
            self._failed("prefetch", exc)
            return 0

    def queued(self, request_id: str, keys: Sequence[ChunkKey]) -> int:
        """A request waits to be served: the daemon's policies hear of it and its held chunks
        are prefetched into DRAM (:meth:`kvtier.store.KVStore.queued`). 0 if unavailable."""
        try:
            reply = self._call("queued", request_id=request_id, keys=list(keys))
            return int(reply["promoted"])  # type: ignore[call-overload]
        except DaemonUnavailable as exc:
            self._failed("queued", exc)
            return 0

    def started(self, request_id: str) -> None:
        """The request announced by :meth:`queued` is being scheduled."""
        try:
            self._call("started", request_id=request_id)
        except DaemonUnavailable as exc:
            self._failed("started", exc)

    def stats(self) -> dict[str, object]:
        """The daemon's snapshot; raises DaemonUnavailable (for ``kvtier store stats``)."""
        return self._call("stats")["stats"]  # type: ignore[return-value]

    def close(self) -> None:
        with self._lock:
            self._drop()
            if self._att is not None:
                self._att.arena.close()
                self._att = None
