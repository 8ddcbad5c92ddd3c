"""The scheduler half across a cache reset (``reset_cache``: vLLM got new weights).

vLLM calls ``reset_cache`` from ``Scheduler.reset_prefix_cache(reset_connector=True)``, between
steps on its engine thread, once it has reset its own prefix cache -- or failed to, while a
block was held (``reset_running_requests=False``: vLLM then returns False, and the caller
retries). With ``reset_running_requests=True`` vLLM raises on that failure before it calls
the connector at all, so a finished request whose save holds its blocks keeps a reset from
happening: ``kvtier.engines.vllm.offline.reset_cache`` (in-process engines) and
``pause_generation(clear_cache=True)`` (the multi-process engine core, which steps until
those saves are done) are the ways round it (docs/vllm-fleet.md, "reset_cache").

No chunk saved before a reset is loaded after it: every key chains the epoch, new and random
at each reset. What was planned before keeps the keys it was planned with -- a save of a
finished request begun before the reset and committed after it lands under the old epoch, and
nothing of a request admitted before is planned again under the new one unless vLLM computes
it again from its first token (:mod:`.scheduler`).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace

log = logging.getLogger(__name__)


class Resets:
    """:class:`~.scheduler.SchedulerSide`'s cache resets (a mixin: its state -- ``epoch``,
    ``_gpu_stale``, the lookups, the planned finishes -- is the scheduler half's, set up in
    ``SchedulerSide.__init__``)."""

    def reset_cache(self) -> bool:
        """From now on no load is served from a chunk saved before. A new epoch is chained into
        every key; answers and promotions made before are dropped; finished requests' saves
        planned and not yet handed to the workers are dropped (under the old epoch they could
        never be loaded again; the workers report them done at the next step with no daemon
        call of their own, so a reset vLLM could not finish succeeds sooner when retried);
        every chunk announced in KV events is removed. When vLLM could not clear its own cache (blocks were
        held), requests admitted over vLLM's local hits are not saved until a reset succeeds,
        since those hits may be the old weights'. The daemon is not asked (the old chunks age
        out), so kvtier's part cannot fail."""
        self.epoch = secrets.token_bytes(16)
        pool = self.block_pool
        try:  # (vLLM's own test: every block but the null one free)
            self._gpu_stale = pool is None or int(pool.num_gpu_blocks) - int(pool.get_num_free_blocks()) != 1
        except Exception:  # noqa: BLE001 - unknown: assume the worst
            self._gpu_stale = True
        # a finish with no keys: the workers report it done without saving (and vote on its
        # ballot, which an engine of several ranks still counts)
        self._finishes = [replace(f, keys=[], block_ids=[], tail_blocks=0) for f in self._finishes]
        self._finish_keys.clear()  # (nor are they widened again: :meth:`_widen_finish`)
        for rid in list(self._pending):
            self._forget_pending(rid)
        self._lookups.clear()
        self._promoted.clear()
        if self.events is not None:
            self.events.clear()
        if self._gpu_stale:
            log.warning("kvtier: cache reset while vLLM's prefix cache held blocks: requests over "
                        "its cached blocks are not saved until a reset clears them")
        else:
            log.info("kvtier: cache reset: chunks saved before it are no longer loaded")
        return True
