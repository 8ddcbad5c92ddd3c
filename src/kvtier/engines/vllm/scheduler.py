"""The connector's scheduler half (vLLM's engine-core process): finds what kvtier holds for a
request, and plans each step's loads and saves.

Every request vLLM allocates blocks for is tracked through an explicit state machine::

    WAITING --alloc--> LOADING (kvtier hit) | RUNNING --preempted--> PREEMPTED
    PREEMPTED --alloc again--> LOADING | RUNNING (vLLM replaces its block list on resume)
    RUNNING --finished--> FINISHING (blocks kept until the worker saved its tail) --> gone

Whole conversations: as a request's tokens -- prompt, then generated -- complete a chunk, that
chunk is saved by the step that computes it; when the request finishes, the chunks left and its
last partial chunk (whole vLLM blocks of it, :func:`kvtier.core.keys.tail_key`) are saved in the
background while vLLM keeps the blocks (``request_finished`` returns True; the worker reports
the request in ``get_finished``). The next turn of the conversation then finds all of this turn's
KV but the blocks' last partial one.

The lookups are :mod:`.lookups`, a request's keys :mod:`.request_keys`, the hints to the
daemon's policies :mod:`.hints`, a cache reset (new weights) :mod:`.resets`, and the per-request
records :mod:`.request_state`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kvtier.core.keys import ChunkKey
from kvtier.engines.vllm.calls import Calls
from kvtier.engines.vllm.events import KVEvents, request_blocks
from kvtier.engines.vllm.hints import Hints
from kvtier.engines.vllm.lookups import (
    Lookups,
    _Lookup,
    _Pending,
)
from kvtier.engines.vllm.plan import KVTierMetadata, KVTierWorkerMeta, Transfer, Write
from kvtier.engines.vllm.request_keys import RequestKeys
from kvtier.engines.vllm.request_state import Phase, _Tracked, skipped
from kvtier.engines.vllm.resets import Resets
from kvtier.engines.vllm.stats import HIT_PREFIX
from kvtier.engines.vllm.votes import Tally
from kvtier.errors import DaemonUnavailable
from kvtier.server.client import StoreClient

log = logging.getLogger(__name__)

PENDING_FREE_S = 0.5
"""How long after a request finished its save's blocks count as about to be freed
(``has_pending_block_frees``); a save slower than that (a stalled daemon) lets vLLM preempt as
it would."""
STALE = b"stale"
"""The epoch of a request whose KV kvtier must never save: admitted over vLLM blocks cached
before a cache reset that did not clear vLLM's own cache (they may be the old weights')."""


class SchedulerSide(Lookups, Hints, RequestKeys, Resets):
    def __init__(self, client: StoreClient, hint_client: StoreClient, block_size: int,
                 load_async: bool = False, wait_s: float = 0.02, lookup_deadline_s: float = 2.0,
                 ranks: int = 1) -> None:
        self.client = client
        self.tally = Tally(ranks)
        """The ballots of an engine of several ranks: every rank votes on every save
        (:mod:`.votes`)."""
        self.wait_s = wait_s
        """How long the engine loop waits for lookups at most, in all, in one step."""
        self._step_waited = 0.0
        """Seconds this step's lookups waited inline so far (reset as the step's plan is built)."""
        self.lookup_deadline_s = lookup_deadline_s
        """How long after it was made a lookup not answered yet is a miss."""
        self._calls = Calls("kvtier-lookup")
        self._pending: dict[str, _Pending] = {}
        self._hint_lock = threading.Lock()
        self._hints_waiting = 0
        self.hints_dropped = 0
        self.hints_malformed = 0
        self.lookups_missed = 0
        """Lookups that were misses because the daemon did not answer in time."""
        self.load_async = load_async
        """Load between steps (vLLM schedules the request once the worker reports its load
        done) instead of layer by layer inside the step that computes the rest of it."""
        self._sources: dict[str, dict[str, int]] = {}
        self._loading: dict[str, list[int]] = {}
        """Requests whose load is planned or running -> the blocks it writes."""
        self._load_failed: set[str] = set()
        self._hint_client = hint_client
        self.block_size = block_size
        self.chunk = client.layout.chunk_tokens if client.layout else block_size
        self.per_chunk = self.chunk // block_size
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[Transfer] = []
        self._finishes: list[Transfer] = []
        self._finish_keys: dict[str, list[ChunkKey]] = {}
        """The full chunks' keys of each finished request in ``_finishes`` (not sent yet): a save
        its last step skipped is added to its finish (:meth:`update_connector_output`)."""
        self._hints = ThreadPoolExecutor(1, "kvtier-hints")
        self.preemptions = 0
        self._freeing: dict[str, float] = {}
        """Finished requests whose blocks vLLM keeps until their save is done -> when."""
        self._free_credits = 0
        """Times ``has_pending_block_frees`` may still say yes: one per finished request whose
        save holds its blocks (each buys one step of waiting instead of one preemption)."""
        self._busy = False
        """Whether the last step computed anything (requests are running)."""
        self._promoted: set[str] = set()
        """Waiting requests whose chunks were promoted into DRAM (:meth:`_promote_waiting`)."""
        self.block_pool = None
        """vLLM's block pool (``bind_gpu_block_pool``): whether a request would fit now."""
        self.epoch: bytes | None = None
        """None until vLLM resets its cache (``reset_cache``: new weights), then 16 random
        bytes chained into every key, new at each reset: chunks saved before it never match
        again, and age out of the tiers."""
        self._gpu_stale = False
        """The last reset did not clear vLLM's own prefix cache (blocks were held): requests
        admitted over local hits may compute over old-weight KV, and are not saved."""
        self.events: KVEvents | None = None
        """vLLM's KV events for what kvtier holds (set by the connector when vLLM publishes)."""
        self.hash_block_size = block_size
        self.lookups_sent = 0
        self.load_failures = 0
        self.hit_tokens: dict[str, int] = {}
        """Tokens vLLM took from kvtier (planned loads), by the tier they were found in."""

    # -- loads ---------------------------------------------------------------------------------
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:  # type: ignore[no-untyped-def]
        rid = str(request.request_id)
        found = self._lookups.pop(rid, None)
        self._forget_pending(rid)
        self._promoted.discard(rid)
        tr = self._tracked.get(rid)
        # over vLLM blocks cached before a reset that did not clear them: never saved
        tainted = self._gpu_stale and (found is None or found.local > 0)
        epoch = STALE if tainted else self.epoch
        if tr is None:
            tr = self._tracked[rid] = _Tracked(request, epoch=epoch)
        elif tr.epoch != self.epoch and not tainted:
            # admitted again (preempted by the reset, or before it; vLLM reports the
            # preemption only at the end of this schedule): its KV is computed again from what
            # vLLM and kvtier hold now, with the new weights: saved under the new epoch
            tr.epoch, tr.keys, tr.stored = self.epoch, [], 0
        tr.block_ids = list(blocks.get_block_ids()[0])
        tr.phase = Phase.RUNNING
        if skipped(request):
            return
        self._hint_later(self._hint, "started", rid)
        if found is not None:
            tr.stored = max(tr.stored, found.chunks)
        if num_external_tokens <= 0:
            return
        tr.phase = Phase.LOADING
        self._sources.pop(rid, None)
        if found is None:  # vLLM loads what no lookup of ours offered: let it recompute all
            log.error("kvtier: vLLM asked for %d tokens of request %s without a lookup", num_external_tokens, rid)
            self._loads.append(Transfer(rid, [], 0, tr.block_ids, skip_blocks=0))
            return
        local, total = found.local, found.local + num_external_tokens
        b, c = self.block_size, self.chunk
        first = local // c
        full = min(found.chunks, total // c)
        tail = (total - full * c) // b
        keys = found.keys[first:full]
        if tail:
            if not (found.tail == tail and full == found.chunks):  # not what the lookup offered
                keys, tail = [], 0
            else:
                keys = found.keys[first : full + 1]
        elif total % c:
            keys = []
        if not keys or total % b:
            log.error("kvtier: vLLM's %d external tokens for request %s do not match the lookup; "
                      "they are recomputed", num_external_tokens, rid)
            keys = []
        load = Transfer(rid, keys, first, tr.block_ids[: -(-total // b)], skip_blocks=local // b,
                        tail_blocks=tail, background=self.load_async)
        self._loads.append(load)
        self._loading[rid] = load.block_ids[load.skip_blocks :]
        sources: dict[str, int] = {}
        for j, tier in enumerate(found.tiers[first : first + len(keys)]):
            lo = max((first + j) * c, local)
            hi = min((first + j + 1) * c, total)
            sources[tier] = sources.get(tier, 0) + max(0, hi - lo)
            self.hit_tokens[tier] = self.hit_tokens.get(tier, 0) + max(0, hi - lo)
        self._sources[rid] = sources
        if keys:
            self._remember(request, found.keys[:full], found.keys[full] if tail else None, tail)

    def hit_sources(self, request, num_external_tokens: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
        """The tiers the request's external tokens come from (tokens per tier name)."""
        got = self._sources.pop(str(request.request_id), {})
        return got if sum(got.values()) == num_external_tokens else {"unspecified": num_external_tokens}

    # -- steps ---------------------------------------------------------------------------------
    def build_connector_meta(self, so) -> KVTierMetadata:  # type: ignore[no-untyped-def]
        meta = KVTierMetadata(loads=self._loads, finishes=self._finishes, verdicts=self.tally.take_verdicts())
        self._loads, self._finishes = [], []
        self._finish_keys.clear()
        self._busy = bool(so.num_scheduled_tokens)
        self._step_waited = 0.0  # the next step's lookups have their own bound
        for rid in getattr(so, "preempted_req_ids", None) or ():
            tr = self._tracked.get(rid)
            if tr is not None:
                tr.phase, tr.block_ids = Phase.PREEMPTED, []
                self.preemptions += 1
        for r in so.scheduled_new_reqs:
            tr = self._tracked.get(r.req_id)
            if tr is None:
                continue
            tr.block_ids = list(r.block_ids[0])
            if r.num_computed_tokens < tr.stored * self.chunk:  # (a load between steps failed)
                tr.stored = r.num_computed_tokens // self.chunk
            self._step(meta, tr, r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id])
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._tracked.get(rid)
            if tr is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # its old blocks were freed; these are all of them
                tr.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tr.block_ids.extend(new_blocks[0])
            computed = cached.num_computed_tokens[i]
            if computed < tr.stored * self.chunk:
                # vLLM went back (blocks whose load failed are recomputed): a worker refuses to
                # save what was computed over them, so those chunks are saved once redone
                tr.stored = computed // self.chunk
            self._step(meta, tr, rid, computed, so.num_scheduled_tokens[rid])
        return meta

    def _step(self, meta: KVTierMetadata, tr: _Tracked, rid: str, computed: int, scheduled: int) -> None:
        """The request computes tokens ``computed..computed + scheduled`` this step: say so, and
        save the full chunks this completes (of the tokens already known: with async scheduling
        the last sampled ones may not be)."""
        tr.phase = Phase.RUNNING
        end = computed + scheduled
        nblocks = min(len(tr.block_ids), -(-end // self.block_size))
        meta.writes.append(Write(rid, tr.block_ids, computed, end, nblocks))  # (shared: never copied)
        if skipped(tr.request) or tr.epoch != self.epoch:
            return
        full = min(end, len(tr.request.all_token_ids)) // self.chunk  # type: ignore[attr-defined]
        if full > tr.stored and full * self.per_chunk <= len(tr.block_ids):
            keys = self._keys_of(tr, full)
            if len(keys) == full:
                meta.saves.append(Transfer(rid, keys[tr.stored :], tr.stored, tr.block_ids[: full * self.per_chunk],
                                           vote=self.tally.ballot()))
                self._remember(tr.request, keys)
                tr.stored = full

    def request_finished(self, request, block_ids: list[int]) -> bool:  # type: ignore[no-untyped-def]
        """Plan the save of what the request computed and kvtier lacks; True if there is such a
        save (vLLM keeps its blocks until the worker reports it in ``get_finished``)."""
        rid = str(request.request_id)
        self._lookups.pop(rid, None)
        self._forget_pending(rid)
        self._promoted.discard(rid)
        self._sources.pop(rid, None)
        self._loading.pop(rid, None)
        self._load_failed.discard(rid)
        tr = self._tracked.pop(rid, None)
        if tr is not None and not skipped(request):
            self._hint_later(self._hint, "finished", rid)
        if tr is None or skipped(request) or tr.epoch != self.epoch \
                or tr.phase in (Phase.PREEMPTED, Phase.WAITING, Phase.LOADING):
            # (a request aborted while it loads between steps: vLLM keeps its blocks until the
            # load is reported done, and they hold nothing kvtier lacks)
            return False
        tokens = list(request.all_token_ids)
        valid = min(request.num_computed_tokens - int(getattr(request, "num_in_flight_tokens", 0) or 0), len(tokens))
        b, c = self.block_size, self.chunk
        valid = min(valid, len(block_ids) * b)
        full, tail = valid // c, (valid % c) // b
        if full <= tr.stored and not tail:
            return False
        try:
            keys = self._keys_of(tr, full)
            if len(keys) < full:
                return False
            first = min(tr.stored, full)
            keys = keys[first:full]
            if tail:
                keys.append(self._tail_key(request, tr.keys, tokens, full, tail))
        except DaemonUnavailable:
            return False
        self._remember(request, tr.keys[:full], keys[-1] if tail else None, tail)
        tr.phase = Phase.FINISHING
        self._freeing[rid] = time.monotonic()
        self._free_credits += 1
        self._finishes.append(Transfer(rid, keys, first, list(block_ids[: full * self.per_chunk + tail]),
                                       tail_blocks=tail, vote=self.tally.ballot()))
        self._finish_keys[rid] = tr.keys[:full]
        return True

    def update_connector_output(self, output) -> None:  # type: ignore[no-untyped-def]
        """A step's outcome from the workers: a request whose load failed (vLLM recomputes the
        blocks) is not offered kvtier's chunks again -- a load that fails for good (a rank that
        lacks its shard, a worker that is disabled) must not be retried forever; a save a
        worker skipped because the daemon was slow is planned again (its blocks still hold it:
        the request runs, or is finishing with its blocks kept)."""
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVTierWorkerMeta):
            if meta.votes:
                self.tally.count(meta.votes)
            for rid, first in meta.unsaved.items():  # saves a worker skipped: planned again
                tr = self._tracked.get(rid)
                if tr is not None and first < tr.stored:
                    tr.stored = first
                elif tr is None:  # it finished in that very step (vLLM tells us that first)
                    self._widen_finish(rid, first)
        bad = set(getattr(output, "invalid_block_ids", None) or ())
        for rid in list(self._loading):
            if bad and bad.intersection(self._loading[rid]) and rid not in self._load_failed:
                self._load_failed.add(rid)
                self.load_failures += 1
        for rid in getattr(output, "finished_recving", None) or ():
            self._loading.pop(rid, None)
        for rid in getattr(output, "finished_sending", None) or ():
            self._freeing.pop(rid, None)
        if not self._freeing:
            self._free_credits = 0

    def _widen_finish(self, rid: str, first: int) -> None:
        """A finished request's last step skipped its save from chunk ``first`` on (the daemon
        was slow, or another writer was writing a chunk): its finish, not sent yet, saves from
        there (the blocks vLLM keeps for it hold those chunks). A finish already sent, or none
        (the request held nothing more to save: vLLM freed its blocks), loses the chunk: a miss
        later, never wrong KV."""
        keys = self._finish_keys.get(rid)
        for n, f in enumerate(self._finishes):
            if f.req_id == rid and keys is not None and first < f.first_chunk <= len(keys):
                self._finishes[n] = replace(f, keys=keys[first : f.first_chunk] + f.keys, first_chunk=first)
                return

    def has_pending_push_work(self) -> bool:
        """Whether vLLM must keep stepping, though no request runs: a ballot's votes or its
        verdict are still on their way (a step carries them), and until they arrive every
        rank holds the save's slots, or a finished request's blocks."""
        return self.tally.pending

    def has_pending_block_frees(self) -> bool:
        """Whether a finished request's save will free its blocks soon (it ended within
        :data:`PENDING_FREE_S`). vLLM asks when a running request finds no free block; on yes
        it schedules no more running requests this step (the rest of the batch waits a step,
        and waiting requests may be admitted) instead of preempting one, which would compute
        all of its KV again. Each finished request buys one such yes, so a stream of finishes
        cannot hold the batch back step after step."""
        if not self._freeing or self._free_credits <= 0:
            return False
        now = time.monotonic()
        if not any(now - t < PENDING_FREE_S for t in self._freeing.values()):
            return False
        self._free_credits -= 1
        return True

    # -- events, counters ----------------------------------------------------------------------
    def _remember(self, request, full: list[ChunkKey], tail: ChunkKey | None = None,  # type: ignore[no-untyped-def]
                  tail_blocks: int = 0) -> None:
        """Follow chunks ``0..`` of ``request`` for KV events (``full``: the keys of its full
        chunks from the first; then a partial chunk of ``tail_blocks`` blocks), with vLLM's
        hashes of their blocks."""
        events = self.events
        if events is None:
            return
        try:
            after = None
            for j, key in enumerate(full):
                if not events.follows(key):
                    events.remember(key, request_blocks(request, j * self.per_chunk, self.per_chunk,
                                                        self.block_size, self.hash_block_size, after))
                after = key
            if tail is not None and tail_blocks and not events.follows(tail):
                events.remember(tail, request_blocks(request, len(full) * self.per_chunk, tail_blocks,
                                                     self.block_size, self.hash_block_size, after))
        except Exception:
            log.exception("kvtier: KV events: cannot follow request %s", getattr(request, "request_id", "?"))

    def take_events(self) -> list[object]:
        return self.events.take() if self.events is not None else []

    def counters(self) -> tuple[dict[str, float], dict[str, float]]:
        """(cumulative counts, gauges) for vLLM's metrics (:mod:`.stats`)."""
        counts: dict[str, float] = {"lookups": self.lookups_sent, "lookup_timeouts": self.lookups_missed,
                                    "load_failures": self.load_failures, "preemptions": self.preemptions,
                                    "hints_dropped": self.hints_dropped,
                                    "hints_malformed": self.hints_malformed, "saves_vetoed": self.tally.vetoed}
        counts.update({HIT_PREFIX + tier: n for tier, n in self.hit_tokens.items()})
        return counts, {"save_backlog_requests": len(self._freeing)}

    def phase(self, req_id: str) -> Phase | None:
        tr = self._tracked.get(req_id)
        return None if tr is None else tr.phase

    def close(self) -> None:
        self._hints.shutdown(wait=False)
        self._calls.close(wait=False)
