"""Transfer handlers: the threads that run one (source tier, destination tier) pair's copies,
and the registry holding one handler per pair."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

HANDLER_THREADS = {("host", "disk"): 2, ("disk", "host"): 2, ("remote", "host"): 2,
                   ("host", "remote"): 1, ("disk", "remote"): 1}
"""Threads per (source, destination) pair: the SSD's queue depth, the remote tier's calls."""


class Handler:
    """The transfers of one (source tier, destination tier) pair, on its own threads."""

    def __init__(self, src: str, dst: str, threads: int) -> None:
        self.name = f"{src}->{dst}"
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"kvtier-{src}-{dst}")

    def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run ``fn`` on this handler's threads and wait for it (the caller holds no lock)."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Transfers:
    """The registry of handlers, one per (source tier, destination tier) pair."""

    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], Handler] = {}

    def register(self, src: str, dst: str, threads: int | None = None) -> Handler:
        handler = Handler(src, dst, HANDLER_THREADS.get((src, dst), 1) if threads is None else threads)
        self._handlers[(src, dst)] = handler
        return handler

    def get(self, src: str, dst: str) -> Handler:
        try:
            return self._handlers[(src, dst)]
        except KeyError:
            return self.register(src, dst)

    def close(self) -> None:
        for handler in self._handlers.values():
            handler.close()
