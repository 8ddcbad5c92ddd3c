"""Wire format between the store daemon and its clients: length-prefixed msgpack maps.

Control only: chunk bytes never cross the socket; they are read and written in the shared DRAM
arena at the byte offsets the daemon hands out.

Requests are ``{"op": NAME, ...}``; replies are ``{"ok": True, ...}`` or
``{"ok": False, "error": MESSAGE}`` (with ``"lost": True`` when the request named a lease the
daemon has ended, ``"refused": True`` when the daemon will not serve this client at all). Keys
travel as 16-byte binary strings.

Every size and count on the wire is bounded (:data:`MAX_MESSAGE`, :data:`MAX_KEYS`,
:data:`MAX_NAME`, :data:`MAX_TOKENS`); :func:`field` and friends check a request's fields and
raise :class:`BadRequest` naming the field, which the daemon answers as an error.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence

import msgpack

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.errors import KVTierError

HEADER = struct.Struct("<I")
MAX_MESSAGE = 8 << 20
VERSION = 3
MAX_KEYS = 1 << 16
"""Chunks one request may name (16M tokens of 256-token chunks)."""
MAX_NAME = 512
"""Bytes of a model id, tenant, page format or request id."""
MAX_TOKENS = 1 << 40
MAX_LEASE = (1 << 63) - 1


class ProtocolError(KVTierError):
    """The peer sent something that is not a valid message."""


class BadRequest(KVTierError, ValueError):
    """A request's field is missing, of the wrong type or out of bounds."""


def send(sock: socket.socket, message: dict[str, object], within_s: float | None = None) -> None:
    """Write ``message``. ``within_s`` (a blocking socket without a Python timeout, the daemon's):
    all of it within that many seconds, however slowly the peer reads (TimeoutError otherwise)."""
    data = msgpack.packb(message, use_bin_type=True)
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE}")
    out = HEADER.pack(len(data)) + data
    if within_s is None:
        sock.sendall(out)
        return
    deadline = time.monotonic() + within_s
    view, sent = memoryview(out), 0
    while sent < len(out):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer did not read the reply in time")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:  # the kernel's send timeout passed
            raise TimeoutError("the peer did not read the reply in time") from None


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None, buf: bytes = b"") -> bytes | None:
    out = bytearray(buf)
    while len(out) < n:
        if deadline is not None:  # the whole message by then, however slowly its bytes come
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the message did not arrive whole in time")
            _recv_timeout(sock, left)
        try:
            part = sock.recv(n - len(out))
        except BlockingIOError:  # the kernel's receive timeout (SO_RCVTIMEO) passed
            if deadline is None:
                raise
            raise TimeoutError("the message did not arrive whole in time") from None
        if not part:
            return None
        out += part
    return bytes(out)


def _recv_timeout(sock: socket.socket, seconds: float) -> None:
    """The kernel's receive timeout (``SO_RCVTIMEO``) of a blocking socket: a read then costs one
    system call (a Python-level timeout polls before each read), and fails with EAGAIN after
    ``seconds`` without data."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    return _TIMEVAL.pack(sec, max(1, usec) if sec == 0 else usec)  # all zero would mean: for ever


_TIMEVAL = struct.Struct("@ll")
IDLE = object()
"""What :func:`recv_request` returns when no request began within its idle time."""


def recv_request(sock: socket.socket, idle_s: float, whole_s: float) -> dict[str, object] | object | None:
    """A daemon's read of the next request on a blocking socket without a Python timeout:
    :data:`IDLE` if none began within ``idle_s`` (0: unless its bytes are there already), None
    when the peer closed, else the message, which must arrive whole within ``whole_s`` of its
    first bytes (TimeoutError otherwise). One system call a read in the common case."""
    try:
        if idle_s <= 0:
            first = sock.recv(HEADER.size, socket.MSG_DONTWAIT)
        else:
            _recv_timeout(sock, idle_s)
            first = sock.recv(HEADER.size)
    except BlockingIOError:
        return IDLE
    if not first:
        return None
    deadline = time.monotonic() + whole_s
    head = _recv_exact(sock, HEADER.size, deadline, first)
    if head is None:
        return None
    return _decode_body(sock, head, deadline)


def recv(sock: socket.socket) -> dict[str, object] | None:
    """The next message, or None when the peer closed the connection (the socket's own timeout
    applies to each read: a client's; the daemon reads with :func:`recv_request`)."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    return _decode_body(sock, head, None)


def _decode_body(sock: socket.socket, head: bytes, deadline: float | None) -> dict[str, object] | None:
    (size,) = HEADER.unpack(head)
    if size > MAX_MESSAGE:
        raise ProtocolError(f"message of {size} bytes exceeds the limit of {MAX_MESSAGE}")
    body = _recv_exact(sock, size, deadline)
    if body is None:
        return None
    try:
        message = msgpack.unpackb(body, raw=False, max_bin_len=MAX_MESSAGE, max_str_len=MAX_MESSAGE,
                                  max_array_len=MAX_KEYS + 16, max_map_len=64, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"undecodable message: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a map")
    return message


# -- request fields -----------------------------------------------------------------------------
def integer(req: dict[str, object], name: str, lo: int, hi: int, default: int | None = None) -> int:
    value = req.get(name, default)
    if value is None:
        raise BadRequest(f"{name} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r:.40}")
    return value


def text(req: dict[str, object], name: str, default: str | None = None) -> str | None:
    value = req.get(name, default)
    if value is None:
        return None
    if not isinstance(value, str) or len(value.encode()) > MAX_NAME:
        raise BadRequest(f"{name} must be a string of at most {MAX_NAME} bytes")
    return value


def keys(req: dict[str, object], name: str = "keys") -> list[ChunkKey]:
    value = req.get(name, [])
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise BadRequest(f"{name} must be a list of at most {MAX_KEYS} keys")
    for k in value:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise BadRequest(f"{name}: a chunk key is {KEY_BYTES} bytes, got {k!r:.40}")
    return [ChunkKey(k) for k in value]


def integers(req: dict[str, object], name: str, lo: int, hi: int, limit: int = MAX_KEYS) -> list[int]:
    value = req.get(name, [])
    if not isinstance(value, list) or len(value) > limit:
        raise BadRequest(f"{name} must be a list of at most {limit} integers")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise BadRequest(f"{name}: every value must be an integer in [{lo}, {hi}], got {v!r:.40}")
    return list(value)  # type: ignore[arg-type]


def within(values: Sequence[int], n: int, name: str) -> None:
    if any(v >= n for v in values):
        raise BadRequest(f"{name} names an index beyond the {n} chunks of the lease")
