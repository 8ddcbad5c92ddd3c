"""Layer-wise pre-loading: cached KV is read layer by layer while the forward pass runs.

A :class:`LayerwiseLoader` reads layer 0 of every hit chunk, then layer 1, ... in a background
thread; the engine's cache layer ``i`` (``kvtier.engines.preloaded_layer.PreloadedLayer`` for
transformers) calls :meth:`LayerwiseLoader.wait` from its ``update``, i.e. when attention layer
``i`` runs, and blocks until layer ``i`` is in memory. So layer ``i+1``
is being read (from DRAM or SSD) while layer ``i`` computes, and only what compute cannot cover
shows in time-to-first-token.

If any layer comes back short (a chunk went missing or failed its checksum), ``wait`` raises
:class:`LoadFailed`; the engine then discards the forward pass and starts again with the prefix
that is still cached. Wrong KV never reaches the model.
"""

from __future__ import annotations

import threading
import time

import torch

from kvtier.errors import KVTierError
from kvtier.store.packing import torch_dtype
from kvtier.store.results import KVCacheAPI, LookupResult


class LoadFailed(KVTierError, RuntimeError):
    """A layer of the cached prefix could not be loaded in full."""


class LayerwiseLoader:
    """Loads ``hit``'s KV into per-layer buffers on ``device``, one layer at a time."""

    def __init__(self, store: KVCacheAPI, hit: LookupResult, device: torch.device | str = "cpu") -> None:
        layout = store.layout
        self.store = store
        self.hit = hit
        self.tokens = hit.hit_tokens
        shape = (layout.num_layers, layout.kv, 1, layout.num_kv_heads, self.tokens, layout.head_dim)
        self._buf = torch.empty(shape, dtype=torch_dtype(layout), device=device)
        # per layer (K, V) as [heads, tokens, head_dim] views for the store to fill
        self._out = [tuple(self._buf[layer, j, 0] for j in range(layout.kv)) for layer in range(layout.num_layers)]
        self._ready = [threading.Event() for _ in range(layout.num_layers)]
        self._loaded = [0] * layout.num_layers
        self._error: BaseException | None = None
        self.load_s = 0.0
        """Seconds the loader thread spent reading."""
        self.wait_s = 0.0
        """Seconds the forward pass spent blocked waiting for a layer."""
        self.tiers = list(hit.tiers)
        self._thread = threading.Thread(target=self._run, name="kvtier-layerwise-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.inference_mode():  # the buffers may be inference tensors (thread-local mode)
                self._load_all()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the forward pass in wait()
            self._error = exc
            for event in self._ready:
                event.set()

    def _load_all(self) -> None:
        for layer in range(len(self._ready)):
            start = time.perf_counter()
            res = self.store.load(self.hit, out=self._out, layers=[layer], promote=False)
            self.load_s += time.perf_counter() - start
            self._loaded[layer] = res.tokens
            self._ready[layer].set()
            if res.tokens < self.tokens:  # this pass will be redone; reading on is wasted
                for event in self._ready:
                    event.set()
                return

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until ``layer`` is loaded; its (K, V) as ``[1, heads, tokens, head_dim]``."""
        start = time.perf_counter()
        self._ready[layer].wait()
        self.wait_s += time.perf_counter() - start
        if self._error is not None:
            raise LoadFailed(f"loading layer {layer} failed: {self._error}") from self._error
        if self._loaded[layer] < self.tokens:
            raise LoadFailed(
                f"layer {layer}: only {self._loaded[layer]} of {self.tokens} cached tokens could be read"
            )
        return self._buf[layer, 0], self._buf[layer, 1]

    def join(self) -> None:
        self._thread.join()

    @property
    def hidden_fraction(self) -> float:
        """Share of the load time that compute hid (1.0: the forward pass never waited)."""
        if self.load_s <= 0:
            return 1.0
        return max(0.0, 1.0 - self.wait_s / self.load_s)
