"""Copies between the daemon's arena (host memory) and vLLM's KV blocks, wherever those are.

On CPU a copy is a plain tensor copy, done when it returns. On CUDA (the worker page-locks the
arena when its KV is on a GPU: :class:`kvtier.server.connection.Arena`) the ordering is made by
construction, never by a global synchronize on the hot path:

- loads are issued on a side stream, non-blocking. Before its first copy the stream waits for
  the compute stream's work issued so far (``start``, called on the engine's thread): a kernel
  still writing or reading a destination block (a block just freed and handed to this load)
  finishes first, and the load wins. Loads between steps wait likewise for an event recorded
  on the compute stream when they were planned (``mark``). One event per layer: ``wait_layer``
  makes the compute stream wait for that layer's copies -- the GPU waits, the host does not;
- saves wait on a save stream of their own for the compute stream's work so far (the layer
  just computed);
- block-index tensors are made once per chunk and step (``ids``): built in page-locked host
  memory and copied non-blocking on the stream that uses them, so no layer forces a host
  synchronization;
- ``sync`` / ``sync_saves`` wait for a stream's copies before the lease over their host slots
  ends, after the forward pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class Copier:
    def __init__(self, device: torch.device, num_layers: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._layers = [threading.Event() for _ in range(num_layers)]
        # Bytes copied, for profiles; each written by one thread only (the step's loads, the
        # loads between steps, the step's saves, the background saves)
        self.loaded_bytes = 0
        self.loaded_bg_bytes = 0
        self.saved_bytes = 0
        self.saved_bg_bytes = 0
        if self.cuda:
            self._load_stream = torch.cuda.Stream(device)
            self._save_stream = torch.cuda.Stream(device)
            self._bg_stream = torch.cuda.Stream(device)
            self._bg_load_stream = torch.cuda.Stream(device)
            self._events = [torch.cuda.Event() for _ in range(num_layers)]

    def ids(self, block_ids: list[int]) -> torch.Tensor:
        """Block indices on the device, for the current stream (its work comes after the copy:
        make it on the stream that uses it, once per chunk and step, not per layer)."""
        if not self.cuda:
            return torch.tensor(block_ids, dtype=torch.long)
        host = torch.tensor(block_ids, dtype=torch.long).pin_memory()
        return host.to(self.device, non_blocking=True)  # the caching allocator keeps host alive

    def load_ids(self, block_ids: list[int]) -> torch.Tensor:
        """:meth:`ids` for the load stream (made on it)."""
        if not self.cuda:
            return self.ids(block_ids)
        with torch.cuda.stream(self._load_stream):
            return self.ids(block_ids)

    # -- loads (one thread per step issues them, layer after layer) ----------------------------
    def start(self) -> None:
        """A step's loads begin (on the engine's thread, before the copy thread issues any):
        they come after every kernel the compute stream has been given so far."""
        for event in self._layers:
            event.clear()
        if self.cuda:
            self._load_stream.wait_stream(torch.cuda.current_stream(self.device))

    def mark(self) -> torch.cuda.Event | None:
        """An event on the compute stream now (the engine's thread), for a load between steps
        to wait for (:meth:`load_now`)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def up(self, pages: torch.Tensor) -> torch.Tensor:
        """Host pages as the device needs them (a non-blocking copy on the load stream)."""
        self.loaded_bytes += pages.nbytes
        return pages.to(self.device, non_blocking=True) if self.cuda else pages

    def load(self, copy: Callable[[], None]) -> None:
        if self.cuda:
            with torch.cuda.stream(self._load_stream):
                copy()
        else:
            copy()

    def layer_done(self, layer: int) -> None:
        if self.cuda:
            self._events[layer].record(self._load_stream)
        self._layers[layer].set()

    def all_done(self) -> None:
        """After the last layer, or a failure: nobody waits for a layer forever."""
        for layer, event in enumerate(self._layers):
            if not event.is_set():
                if self.cuda:
                    self._events[layer].record(self._load_stream)
                event.set()

    def wait_layer(self, layer: int) -> None:
        """Before ``layer``'s attention: its copies are issued (host) and land first (device)."""
        self._layers[layer].wait()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._events[layer])

    def sync(self) -> None:
        """Every load copy has landed: the read lease over their host slots may end."""
        if self.cuda:
            self._load_stream.synchronize()

    # -- loads between steps (vLLM's async loading: a thread of their own) ----------------------
    def load_now(self, kv: torch.Tensor, adapter, ids: torch.Tensor, pages: torch.Tensor,  # type: ignore[no-untyped-def]
                 after: torch.cuda.Event | None = None) -> None:
        """Copy ``pages`` into blocks ``ids`` (made by :meth:`bg_ids`) of ``kv``, after ``after``
        (:meth:`mark`, when the load was planned)."""
        self.loaded_bg_bytes += pages.nbytes
        if not self.cuda:
            adapter.scatter(kv, ids, pages)
            return
        with torch.cuda.stream(self._bg_load_stream):
            if after is not None:
                self._bg_load_stream.wait_event(after)
            adapter.scatter(kv, ids, pages.to(self.device, non_blocking=True))

    def bg_ids(self, block_ids: list[int]) -> torch.Tensor:
        """:meth:`ids` for loads between steps (made on their stream)."""
        if not self.cuda:
            return self.ids(block_ids)
        with torch.cuda.stream(self._bg_load_stream):
            return self.ids(block_ids)

    def sync_now(self) -> None:
        if self.cuda:
            self._bg_load_stream.synchronize()

    # -- saves ---------------------------------------------------------------------------------
    def save(self, dst: torch.Tensor, src: torch.Tensor, background: bool = False) -> None:
        """Copy device pages ``src`` into host slot ``dst``, after the compute stream's work so
        far (``src`` was gathered on it)."""
        if background:
            self.saved_bg_bytes += dst.nbytes
        else:
            self.saved_bytes += dst.nbytes
        if not self.cuda:
            dst.copy_(src)
            return
        stream = self._bg_stream if background else self._save_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        src.record_stream(stream)  # its memory is not reused before the copy is done
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def save_pages(self, dst: torch.Tensor, kv: torch.Tensor, adapter, ids: torch.Tensor,  # type: ignore[no-untyped-def]
                   background: bool = False) -> None:
        """Copy pages ``ids`` of ``kv`` into host slot ``dst``: on CPU in one pass, straight into
        the slot (``adapter.gather_into``); else gathered, then copied as :meth:`save` does."""
        if not self.cuda and adapter.gather_into(kv, ids, dst):
            if background:
                self.saved_bg_bytes += dst.nbytes
            else:
                self.saved_bytes += dst.nbytes
            return
        self.save(dst, adapter.gather(kv, ids), background=background)

    def sync_saves(self, background: bool = False) -> None:
        """Every save copy has landed: the write lease may be committed."""
        if self.cuda:
            (self._bg_stream if background else self._save_stream).synchronize()
