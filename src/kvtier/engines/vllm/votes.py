"""Commits every rank agrees on, in an engine of several ranks (tensor- and pipeline-parallel).

Each rank stores its own shard of a chunk under its own namespace (:mod:`.pages`), and each
shard depends on every other rank's KV: a tensor-parallel rank's attention output is reduced
with the others', and a later pipeline stage computes from an earlier stage's hidden states. So
when one rank's load fails (its blocks are recomputed), what *any* rank computed over those
blocks is wrong, though that rank's own blocks arrived: a rank must never commit a chunk that
another rank found suspect (:mod:`.worker`), or a later lookup loads a wrong shard beside a
right one, with no error anywhere.

The ranks agree through vLLM's own channel, not a collective of their own: a collective across
pipeline stages inside ``wait_for_save`` deadlocks (stage 0 would wait for stage 1, which waits
for stage 0's hidden states, sent after that hook), and one across tensor-parallel ranks only
would miss the stages. Instead:

1. the scheduler half gives every planned save and finish a ballot (:attr:`.plan.Transfer.vote`);
2. each rank copies its shard into its write lease as usual, then *holds* the lease and votes
   (commit only if the lease is whole and nothing of the save is suspect on this rank) in its
   worker metadata, which vLLM gathers from every rank and merges
   (:meth:`.plan.KVTierWorkerMeta.aggregate`);
3. once every rank has voted on a ballot (:class:`Tally`), the scheduler half sends the verdict
   in a later step's metadata (:attr:`.plan.KVTierMetadata.verdicts`): every rank commits what
   it holds for it, or abandons it. A finished request's save starts only on a yes.

While verdicts are owed the connector asks vLLM to keep stepping (``has_pending_push_work``), so
an engine that goes idle still delivers them. A rank that never hears a verdict (a lost
scheduler) abandons what it holds after :data:`VERDICT_WAIT_S`: abandoning is always safe.
With one rank there is no one to agree with: saves are committed at the end of their step.
"""

from __future__ import annotations

import itertools
import logging
import time

from kvtier.engines.vllm.plan import KVTierMetadata
from kvtier.server.lease_client import WriteLease

log = logging.getLogger(__name__)

VERDICT_WAIT_S = 60.0
"""How long a rank holds a save's lease (or a finished request's blocks) for a verdict at most."""


def engine_ranks(worker: bool, ranks: int) -> tuple[int, int]:
    """This worker's (tensor-parallel, pipeline-parallel) ranks; (0, 0) in the scheduler. In an
    engine of ``ranks`` > 1 ranks a worker that cannot tell its own would store its shard under
    rank 0's namespace (and load rank 0's): refused."""
    if not worker:
        return 0, 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception as exc:  # (not initialized)
        if ranks > 1:
            raise ValueError(f"kvtier: a worker of an engine of {ranks} ranks cannot tell its own rank "
                             f"({exc}); its shard would be named as another's") from exc
        return 0, 0


def check_executor(parallel_config, ranks: int) -> None:  # type: ignore[no-untyped-def]
    """The ranks of a multi-rank engine agree on every commit through the metadata vLLM's
    executor gathers from all of them (:mod:`.votes`). ``external_launcher`` runs a scheduler
    per rank, each hearing only its own: the ranks could never agree. Refused, saying why."""
    backend = str(getattr(parallel_config, "distributed_executor_backend", "") or "")
    if ranks > 1 and backend == "external_launcher":
        raise ValueError(
            "kvtier cannot run under distributed_executor_backend='external_launcher' with tensor- or "
            f"pipeline-parallel size > 1 ({ranks} ranks): each rank schedules alone there, so the ranks "
            "cannot agree on what to commit (a rank's shard depends on every other's). Use the 'mp' or "
            "'ray' executor, or leave kv_transfer_config out")


class Tally:
    """The scheduler half's ballots: the votes of ``ranks`` ranks counted, verdicts handed out."""

    def __init__(self, ranks: int) -> None:
        if ranks < 1:
            raise ValueError(f"an engine has at least one rank, got {ranks}")
        self.ranks = ranks
        self._ids = itertools.count(1)
        self._open: dict[int, tuple[int, bool]] = {}
        """Ballots given out -> (ranks that voted so far, whether all of them said commit)."""
        self._verdicts: dict[int, bool] = {}
        """Ballots every rank voted on, not sent yet."""
        self.vetoed = 0
        """Ballots some rank voted against (its shard was suspect, or it could not save)."""

    def ballot(self) -> int:
        """A new ballot for a planned save or finish (0: one rank, no vote)."""
        if self.ranks == 1:
            return 0
        ballot = next(self._ids)
        self._open[ballot] = (0, True)
        return ballot

    def count(self, votes: dict[int, tuple[int, bool]]) -> None:
        """Votes from a step's output (every rank's, merged by vLLM)."""
        for ballot, (n, ok) in votes.items():
            if ballot not in self._open:
                log.warning("kvtier: votes on ballot %d, which is not open; ignored", ballot)
                continue
            had_n, had_ok = self._open[ballot]
            n, ok = had_n + int(n), had_ok and bool(ok)
            if n < self.ranks:
                self._open[ballot] = (n, ok)
                continue
            del self._open[ballot]
            self._verdicts[ballot] = ok
            self.vetoed += not ok

    def take_verdicts(self) -> dict[int, bool]:
        """The verdicts for the next step's metadata (each handed out once)."""
        out, self._verdicts = self._verdicts, {}
        return out

    @property
    def pending(self) -> bool:
        """Whether a ballot is open or a verdict unsent (vLLM must step to deliver it)."""
        return bool(self._open or self._verdicts)


class Votes:
    """:class:`~.worker.WorkerSide`'s part in the ballots (a mixin: its state is the worker
    half's, set up in ``WorkerSide.__init__``: ``_held``, ``_held_finishes``, ``_ballots``)."""

    def _vote(self, meta: KVTierMetadata, leases: list[WriteLease | None], ok: list[bool]) -> None:
        """The end of a step of a multi-rank engine: vote on each of its saves and finishes
        (``ok``, in the plan's order); hold what may be committed until the verdict."""
        now = time.monotonic()
        for save, lease, good in zip(meta.saves, leases, ok, strict=False):
            self._ballots[save.vote] = good
            if lease is None:
                continue
            if not good:  # the verdict can only be no
                self._calls.submit(lambda lease=lease: self.client.abandon(lease))
                continue
            self._report_busy(save, lease, 0)
            if len(lease.views) < len(save.keys):  # no room for the rest now: planned again
                self._skipped(save, len(lease.views))
            self._held[save.vote] = (now, lease)
        for f, good in zip(meta.finishes, ok[len(meta.saves) :], strict=True):
            self._ballots[f.vote] = good
            if good:
                self._held_finishes[f.vote] = (now, f)
            else:
                self._mark_done(f.req_id)  # vLLM frees its blocks: nothing of it is saved

    def _apply_verdicts(self, verdicts: dict[int, bool]) -> None:
        """Commit or abandon what this rank holds for each decided ballot; start or drop the
        finished requests' saves; give up on what waited for a verdict too long."""
        for ballot, good in verdicts.items():
            held = self._held.pop(ballot, None)
            if held is not None:
                lease = held[1]
                if good:
                    self._calls.submit(lambda lease=lease: self.client.commit(lease))
                else:
                    self._calls.submit(lambda lease=lease: self.client.abandon(lease))
            finish = self._held_finishes.pop(ballot, None)
            if finish is not None:
                if good:
                    self._start_finish(finish[1])
                else:
                    self._mark_done(finish[1].req_id)
        if not (self._held or self._held_finishes):
            return
        too_old = time.monotonic() - VERDICT_WAIT_S
        for ballot in [b for b, (t, _) in self._held.items() if t < too_old]:
            lease = self._held.pop(ballot)[1]
            log.warning("kvtier: no verdict on ballot %d in %.0f s; its save is abandoned", ballot, VERDICT_WAIT_S)
            self._calls.submit(lambda lease=lease: self.client.abandon(lease))
        for ballot in [b for b, (t, _) in self._held_finishes.items() if t < too_old]:
            f = self._held_finishes.pop(ballot)[1]
            log.warning("kvtier: no verdict on ballot %d in %.0f s; request %s is not saved",
                        ballot, VERDICT_WAIT_S, f.req_id)
            self._mark_done(f.req_id)

    def _take_votes(self) -> dict[int, tuple[int, bool]]:
        out, self._ballots = {b: (1, ok) for b, ok in self._ballots.items()}, {}
        return out
