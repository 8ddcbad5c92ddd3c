"""The worker half across vLLM's sleep mode (vLLM 0.33 and later): ``unregister`` before vLLM
frees the memory under its KV cache, ``restore`` once that memory is backed again.

vLLM calls ``KVConnectorBase_V1.unregister_kv_caches`` when it sleeps (level 1 or 2), when it
discards the ``kv_cache`` tag, and (0.34) when it lends an emptied extensible KV cache to a
weight update; ``restore_kv_caches`` when it wakes the KV cache up or the update is done. In
between, the pages under vLLM's KV tensors are unmapped: a copy that touches them then reads
garbage or, on a GPU, faults. vLLM keeps the tensors' addresses (its CuMem allocator and the
extensible KV cache both map new pages at the same addresses), so the worker keeps the tensors
vLLM registered and uses them again as they are at ``restore``; what they held is gone, and
vLLM reset its prefix cache before it slept, so no block is read as a hit after. (It resets
kvtier's too, ``reset_cache``, unless -- vLLM 0.34 -- it sleeps with ``reset_connector=False``
for weights that stay: then the chunks saved before, the saves drained here included, load
after the wake-up.)

Before it returns, ``unregister`` drains every copy that touches vLLM's KV: a step vLLM never
ended is ended as a failed one (nothing of it is committed); the loads between steps already
under way finish (those still queued miss); the finished requests' saves queued on their
thread are made; the copy streams are synchronized; and the finished requests' saves not
begun otherwise -- copied inline (KV in host memory), or waiting for the ranks' verdict
(:mod:`.votes`) -- are dropped and reported done, so vLLM frees their blocks (a verdict that
comes later finds nothing to start). The saves of a step already copied into the arena and
held for a verdict stay held: they touch vLLM's KV no more. Until ``restore`` every load is a
miss (its blocks are reported as load errors: vLLM recomputes them) and nothing is saved,
whatever the scheduler plans. Both are idempotent; a worker kvtier disabled at ``register``
stays disabled.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

log = logging.getLogger(__name__)

DRAIN_LOG_S = 10.0
"""How often a drain still waiting says so (it waits on: a copy cut off would fault)."""


class Sleep:
    """:class:`~.worker.WorkerSide` across vLLM's sleep (a mixin: its state is the worker half's,
    set up in ``WorkerSide.__init__``; ``_asleep`` is set here)."""

    _asleep: tuple[list[torch.Tensor], dict[str, int], bool] | None = None
    """While unregistered: (the KV tensors, their layers by name, whether kvtier was enabled)."""

    @property
    def asleep(self) -> bool:
        """Whether vLLM's KV cache is unregistered (between ``unregister`` and ``restore``)."""
        return self._asleep is not None

    def unregister(self) -> None:
        """Drain every copy touching vLLM's KV, then touch it no more until :meth:`restore`."""
        if self._asleep is not None:
            return
        enabled, self.enabled = self.enabled, False  # loads queued from now miss; nothing is reserved
        if not self._ended:  # (vLLM ends every step before it sleeps)
            self._end_step(failed=True)
        for pool in (self._receiving, self._finishing):  # one thread each, first in first out
            _drain(pool)
        self._drop_saving()  # copied inline, on the engine's thread: not begun, never will be
        for _, f in self._held_finishes.values():  # waiting for a verdict: never begun either
            self._mark_done(f.req_id)
        self._held_finishes = {}
        if self._copier is not None:
            self._copier.sync()
            self._copier.sync_now()
            self._copier.sync_saves()
            self._copier.sync_saves(background=True)
        self._asleep = (self.kv, self._layer_of, enabled)
        self.kv, self._layer_of = [], {}
        log.info("kvtier: vLLM's KV cache unregistered (sleep): loads miss and nothing is saved until it is back")

    def restore(self) -> None:
        """vLLM's KV cache is backed again: load and save as before :meth:`unregister`."""
        if self._asleep is None:
            return
        self.kv, self._layer_of, self.enabled = self._asleep
        self._asleep = None
        log.info("kvtier: vLLM's KV cache restored (wake-up)")


def _drain(pool: ThreadPoolExecutor) -> None:
    """Wait until every task submitted to ``pool`` (one thread) before now has run."""
    marker: Future = pool.submit(lambda: None)
    while True:
        try:
            marker.result(timeout=DRAIN_LOG_S)
            return
        except FutureTimeout:
            log.warning("kvtier: still waiting for copies into or out of vLLM's KV cache before it is freed")
