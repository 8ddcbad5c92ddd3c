"""Host staging buffers of the remote tiers, reused by size class (:class:`BufferPool`)."""

from __future__ import annotations

import threading

import torch

MIB = 1 << 20


def size_class(size: int) -> int:
    """Powers of two from 64 KiB up to 1 MiB, then whole MiB."""
    return 1 << max(16, (size - 1).bit_length()) if size <= MIB else -(-size // MIB) * MIB


class BufferPool:
    """Host buffers reused by size class, so that steady writes and reads do not fault in fresh
    memory for every chunk (expensive on virtual machines). Thread-safe; holds at most
    ``keep_bytes`` of idle buffers. Subclasses hook ``_new`` and ``_drop`` (registration)."""

    def __init__(self, keep_bytes: int = 512 * MIB) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._keep = keep_bytes
        self._pool_lock = threading.Lock()

    def take(self, size: int) -> torch.Tensor:
        """A buffer of at least ``size`` bytes (slice it); give it back when done."""
        cls = size_class(size)
        with self._pool_lock:
            stack = self._free.get(cls)
            if stack:
                self._kept -= cls
                return stack.pop()
        return self._new(cls)

    def give(self, buf: torch.Tensor) -> None:
        cls = buf.numel()
        with self._pool_lock:
            if self._kept + cls <= self._keep:
                self._free.setdefault(cls, []).append(buf)
                self._kept += cls
                return
        self._drop(buf)

    def clear(self) -> None:
        with self._pool_lock:
            bufs = [b for stack in self._free.values() for b in stack]
            self._free.clear()
            self._kept = 0
        for b in bufs:
            self._drop(b)

    def _new(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)

    def _drop(self, buf: torch.Tensor) -> None:
        pass
