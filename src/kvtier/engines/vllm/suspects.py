"""Which of vLLM's blocks hold KV kvtier must never save.

A block is *suspect* when its load failed, or when it was computed over a suspect block (vLLM's
prefix cache shares blocks between requests, and a step scheduled before a failure was known
computes over it too), until a step computes it again from its first token. A save or a
finished request's save that covers a suspect block is never committed (:mod:`.worker`; in an
engine of several ranks, no rank commits it: :mod:`.votes`)."""

from __future__ import annotations

from kvtier.engines.vllm.plan import Transfer


class Suspects:
    """:class:`~.worker.WorkerSide`'s suspect blocks (a mixin: its state, ``_suspect``, and the
    step's plan, ``_meta``, are the worker half's)."""

    def _spread(self) -> None:
        """What each request computed this step is suspect if it attended to a suspect block it
        did not compute again itself; sound again if it computed it from its first token."""
        if not self._suspect:  # the usual step: nothing to spread (and nothing to clean)
            return
        b = self.block_size
        changed = True
        while changed:  # a request may read blocks another one computes in the same step
            changed = False
            for w in self._meta.writes:
                first_new = -(-w.start // b)  # blocks computed from their first token
                before = w.block_ids[: w.start // b + (1 if w.start % b else 0)]
                written = w.block_ids[w.start // b :]
                if any(blk in self._suspect for blk in before) and not all(x in self._suspect for x in written):
                    self._suspect.update(written)
                    changed = True
                elif not any(blk in self._suspect for blk in before):
                    fresh = w.block_ids[first_new:]
                    if any(x in self._suspect for x in fresh):
                        self._suspect.difference_update(fresh)
                        changed = True

    def _is_suspect(self, t: Transfer) -> bool:
        return bool(self._suspect) and any(blk in self._suspect for blk in t.all_blocks(self.per_chunk))
