"""Wire format between the store daemon and its clients: length-prefixed msgpack maps.

Control only: chunk bytes never cross the socket; they are read and written in the shared DRAM
arena at the slots the daemon hands out.

Requests are ``{"op": NAME, ...}``; replies are ``{"ok": True, ...}`` or
``{"ok": False, "error": MESSAGE}``. Keys travel as 16-byte binary strings.
"""

from __future__ import annotations

import socket
import struct

import msgpack

HEADER = struct.Struct("<I")
MAX_MESSAGE = 64 << 20
VERSION = 1


class ProtocolError(Exception):
    """The peer sent something that is not a valid message."""


def send(sock: socket.socket, message: dict[str, object]) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    sock.sendall(HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def recv(sock: socket.socket) -> dict[str, object] | None:
    """The next message, or None when the peer closed the connection."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_MESSAGE:
        raise ProtocolError(f"message of {size} bytes exceeds the limit of {MAX_MESSAGE}")
    body = _recv_exact(sock, size)
    if body is None:
        return None
    try:
        message = msgpack.unpackb(body, raw=False)
    except Exception as exc:
        raise ProtocolError(f"undecodable message: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a map")
    return message
