"""Page-aligned I/O of the SSD tier: staging buffers reused across I/Os, and positional reads
and writes that run to the end of their buffers."""

from __future__ import annotations

import mmap
import os
import threading

from kvtier.tiers.base import round_up


class _BufferPool:
    """Page-aligned staging buffers (anonymous mappings), reused across I/Os."""

    def __init__(self, keep: int = 8) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._kept = 0
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        size = round_up(size)
        with self._lock:
            stack = self._free.get(size)
            if stack:
                self._kept -= 1
                return stack.pop()
        return mmap.mmap(-1, size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._kept < self._keep:
                self._free.setdefault(len(buf), []).append(buf)
                self._kept += 1
                return
        try:
            buf.close()
        except BufferError:
            pass


def _full_preadv(fd: int, view: memoryview, pos: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], pos + done)
        if n == 0:
            break
        done += n
    return done


def _full_pwritev(fd: int, bufs: list[memoryview], pos: int) -> None:
    done = os.pwritev(fd, bufs, pos)
    total = sum(len(b) for b in bufs)
    if done == total:
        return
    flat = memoryview(b"".join(bufs))  # a short write: rare enough to finish the simple way
    while done < total:
        done += os.pwritev(fd, [flat[done:]], pos + done)
