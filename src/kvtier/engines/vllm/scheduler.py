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

A lookup (``get_num_new_matched_tokens``, which vLLM may call several times for one request and
requires to be free of side effects) asks the daemon for the longest held run of full chunks,
then for the longest held partial chunk after it, and remembers what it found for
``update_state_after_alloc``. It changes nothing in vLLM or in the connector's state; the
daemon counts the lookup and its policy sees the chunks touched (under the request's id, so a
request looked up twice is one use).

vLLM's engine loop never waits on the daemon for long (:mod:`.calls`): a lookup runs on a
thread of its own, sent when the request arrives (``on_new_request``, for no local tokens: it
answers whatever vLLM's own prefix cache then holds). The loop waits for a request's first
answer at most ``wait_s`` (20 ms by default) in a step while no request is running; while some
run, at most :data:`ROOM_WAIT_S` (2 ms) in all, and only for requests vLLM's pool has free
blocks for (the step then admits them: a prefill step; a decode-only step waits only when such
an answer is more than that late). One not back then is asked about again at the next step
(vLLM's "not determined yet": the request waits, the others run), and is a miss once ``lookup_deadline_s``
has passed since it was made; while the daemon has not answered a call for longer than
``lookup_deadline_s`` (it is stalled), new requests miss at once without a call. A request
asked about again (it waits for blocks at the head of the queue), or first asked about long
after it arrived, gets its last answer at once, refreshed in the background, and the chunks of
it that vLLM lacks and that lie below DRAM are promoted into DRAM then, once, so the step that
loads it does not wait for SSD. Hints (queued, started, finished, those
promotions) go out on another thread and are dropped, counted, while :data:`MAX_HINTS` of them
wait.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from kvtier.core.keys import ROOT_KEY, ChunkKey, chunk_tokens_of, image_extras, tail_key
from kvtier.core.request_extras import request_head, tagged
from kvtier.engines.vllm.calls import Calls
from kvtier.engines.vllm.events import KVEvents, request_blocks
from kvtier.engines.vllm.plan import KVTierMetadata, KVTierWorkerMeta, Transfer, Write
from kvtier.engines.vllm.stats import HIT_PREFIX
from kvtier.errors import DaemonUnavailable
from kvtier.server.client import StoreClient

log = logging.getLogger(__name__)

MAX_HINTS = 1024
"""Hints waiting to be sent at most; more are dropped (a stalled daemon must not grow a queue)."""
MAX_PENDING_LOOKUPS = 4096
PENDING_FREE_S = 0.5
"""How long after a request finished its save's blocks count as about to be freed
(``has_pending_block_frees``); a save slower than that (a stalled daemon) lets vLLM preempt as
it would."""
STALE = b"stale"
"""The epoch of a request whose KV kvtier must never save: admitted over vLLM blocks cached
before a cache reset that did not clear vLLM's own cache (they may be the old weights')."""
ROOM_WAIT_S = 0.002
"""How long in all, in a step in which requests run, the loop waits for the first answers of
requests vLLM's pool has room for (the step then admits them: a prefill step; a decode-only
step waits only when such an answer is later than this); without it a request arriving while
others decode would wait a step for nothing."""
LOOKUP_REUSE_S = 1.0
"""How old a waiting request's answer may be before it is refreshed in the background while
vLLM asks again each step (the daemon is asked once a second at most, not every step, and the
loop never waits for a refresh; a chunk evicted meanwhile is a failed load, which vLLM
recomputes)."""


class Phase(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHING = "finishing"


def skipped(request) -> bool:  # type: ignore[no-untyped-def]
    """A request may opt out: ``SamplingParams(extra_args={"kv_transfer_params":
    {"kvtier": "skip"}})`` -- no lookup, no save (a baseline run, a private prompt)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if getattr(request, "prompt_embeds", None) is not None:
        return True  # its KV depends on embeddings, not on token ids a key could name
    return params.get("kvtier") == "skip"


@dataclass
class _Lookup:
    """What the last lookup of a request found: ``chunks`` full chunks, then a partial chunk of
    ``tail`` blocks (key last in ``keys``) when ``tail``; for ``local`` tokens vLLM had."""

    keys: list[ChunkKey]
    chunks: int
    tail: int
    local: int
    num_tokens: int
    tiers: list[str] = field(default_factory=list)
    """The tier of each of ``keys``, as the daemon said."""
    at: float = 0.0
    """When (``time.monotonic``): a request waiting for blocks is asked about every step,
    and the answer is reused for :data:`LOOKUP_REUSE_S`."""

    def at_local(self, local: int) -> _Lookup:
        """This answer for a request vLLM now has ``local`` tokens of (see :func:`_serves`)."""
        return self if local == self.local else replace(self, local=local)


def _serves(num_tokens: int, local: int, n: int, num_computed_tokens: int) -> bool:
    """Whether a lookup made for ``num_tokens`` tokens of which vLLM had ``local`` answers one
    for ``n`` of which it has ``num_computed_tokens``: the same tokens, and vLLM has at least as
    many (a lookup probes the partial chunk past every local hit it was made for, so one made
    for fewer local tokens -- the lookup sent when the request arrived, for none -- found all a
    later one would)."""
    return num_tokens == n and local <= num_computed_tokens


@dataclass
class _Pending:
    """A lookup made for a request, not answered yet."""

    future: Future
    num_tokens: int
    local: int
    since: float


@dataclass
class _Tracked:
    request: object  # vLLM's Request: its all_token_ids grow as it generates
    phase: Phase = Phase.WAITING
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0
    """Full chunks known stored in kvtier (hit, or planned for saving)."""
    keys: list[ChunkKey] = field(default_factory=list)
    """The keys of its full chunks, as far as computed."""
    epoch: bytes | None = None
    """The cache epoch it was admitted in: after a ``reset_cache`` nothing of it is saved (its
    KV may be of the weights before the reset)."""


class SchedulerSide:
    def __init__(self, client: StoreClient, hint_client: StoreClient, block_size: int,
                 load_async: bool = False, wait_s: float = 0.02, lookup_deadline_s: float = 2.0) -> None:
        self.client = client
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

    # -- keys ----------------------------------------------------------------------------------
    def _extra(self, request, span: tuple[int, int] | None = None) -> dict[int, bytes] | None:  # type: ignore[no-untyped-def]
        """What besides token ids makes a request's KV, as vLLM's own block hashes have it,
        chained into the keys: its ``cache_salt`` and LoRA adapter (name and path; into the first
        chunk's key, so into every key) and the content hash of each image (into the chunks its
        placeholder tokens lie in; with ``span``, only of the images within those tokens -- a
        partial chunk's). Each field is length-prefixed, so no two sets of them read alike."""
        extras: dict[int, bytes] = {}
        lora = getattr(request, "lora_request", None)
        head = request_head(salt=getattr(request, "cache_salt", None), epoch=self.epoch,
                            lora=None if lora is None else (str(getattr(lora, "lora_name", lora)),
                                                            str(getattr(lora, "lora_path", ""))))
        if head:
            extras[0] = head
        spans = []
        for f in getattr(request, "mm_features", None) or ():
            lo, hi = f.mm_position.offset, f.mm_position.offset + f.mm_position.length
            if span is not None:
                lo, hi = max(lo, span[0]), min(hi, span[1])
            if lo < hi:
                spans.append((lo, hi, tagged(b"image", f.identifier).hex()))
        for i, more in image_extras(spans, self.chunk).items():
            extras[i] = extras.get(i, b"") + more
        return extras or None

    def _full_keys(self, request, tokens: list[int]) -> list[ChunkKey]:  # type: ignore[no-untyped-def]
        return chunk_tokens_of(tokens, self.client.namespace(), self.chunk, self._extra(request)).keys

    def _tail_key(self, request, keys: list[ChunkKey], tokens: list[int], chunk: int, blocks: int) -> ChunkKey:  # type: ignore[no-untyped-def]
        parent = keys[chunk - 1] if chunk else ROOT_KEY
        start = chunk * self.chunk
        extra = (self._extra(request, (start, start + blocks * self.block_size)) or {}).get(chunk)
        return tail_key(parent, self.client.namespace(), tokens[start : start + blocks * self.block_size], extra)

    def _keys_of(self, tr: _Tracked, chunks: int) -> list[ChunkKey]:
        """The keys of the request's first ``chunks`` chunks -- only ever of tokens whose KV is
        computed (a token sampled but not yet computed may still be replaced)."""
        if len(tr.keys) < chunks:
            tokens = list(tr.request.all_token_ids)  # type: ignore[attr-defined]
            tr.keys = self._full_keys(tr.request, tokens[: chunks * self.chunk])
        return tr.keys[:chunks]

    # -- lookups -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:  # type: ignore[no-untyped-def]
        rid = str(request.request_id)
        n = len(request.all_token_ids) - 1  # one token must be left to compute
        if skipped(request) or n < self.block_size or rid in self._load_failed:
            return 0, False  # (a request whose load failed is computed, not offered it again)
        now = time.monotonic()
        pending = self._pending.get(rid)
        if pending is not None and not _serves(pending.num_tokens, pending.local, n, num_computed_tokens):
            pending.future.cancel()  # asked about other tokens now: that answer is of no use
            del self._pending[rid]
            pending = None
        seen = self._lookups.get(rid)
        if seen is not None and _serves(seen.num_tokens, seen.local, n, num_computed_tokens):
            # asked again (the request waits for blocks): the last answer, never a wait; it is
            # refreshed in the background once it is LOOKUP_REUSE_S old (chunks saved since --
            # the last turn's tail -- are found; a chunk evicted meanwhile is a failed load,
            # which vLLM recomputes)
            if pending is not None and (pending.future.done() or now - pending.since >= self.lookup_deadline_s):
                del self._pending[rid]
                fresh = self._result(pending.future) if pending.future.done() else None
                if fresh is not None:
                    seen = self._lookups[rid] = fresh
                elif not pending.future.done() or now - seen.at >= 2 * LOOKUP_REUSE_S:
                    # the daemon is stalled, or the answer is too old to trust: a miss now
                    pending.future.cancel()
                    del self._lookups[rid]
                    self.lookups_missed += 1
                    return 0, False
                # (a refresh that failed at once -- a dropped connection -- leaves the last
                # answer standing a while; a load of a chunk gone since is a failed load)
            elif pending is None and now - seen.at >= LOOKUP_REUSE_S:
                if self._calls.stalled(self.lookup_deadline_s):
                    del self._lookups[rid]
                    self.lookups_missed += 1
                    return 0, False
                self._submit(rid, request, n, num_computed_tokens, now)
            seen = self._lookups[rid] = seen.at_local(num_computed_tokens)
            self._promote_waiting(rid, seen)  # asked again: it waits at the queue's head
            return self._external(seen, num_computed_tokens)
        if pending is None:
            if self._calls.stalled(self.lookup_deadline_s) or self._calls.pending >= MAX_PENDING_LOOKUPS:
                self.lookups_missed += 1  # a call has been waiting longer than this one may:
                return 0, False           # the daemon is stalled, a miss now without a call
            pending = self._submit(rid, request, n, num_computed_tokens, now)
        # The first answer for these tokens (asked for when the request arrived). While no
        # request runs the loop waits for it inline ``wait_s`` in all for a step however many
        # requests wait (nobody else's step is delayed); while some run, ROOM_WAIT_S in all
        # for requests vLLM's pool has room for (the step admits them: it prefills anyway),
        # else not at all; while a call is already late, never. An answer not back is taken
        # at the next step (vLLM's "not determined yet": this request waits one step).
        bound = (self.wait_s if not self._busy
                 else ROOM_WAIT_S if self._fits(request, num_computed_tokens) else 0.0)
        wait = 0.0 if self._calls.stalled(self.wait_s) else max(0.0, bound - self._step_waited)
        began = time.monotonic()
        found = self._calls.wait(pending.future, max(0.0, min(wait, pending.since + self.lookup_deadline_s - now)),
                                 None)
        self._step_waited += time.monotonic() - began
        if found is None:
            if pending.future.done() or time.monotonic() - pending.since >= self.lookup_deadline_s:
                del self._pending[rid]  # failed, or too late: a miss (a late answer is dropped)
                self.lookups_missed += not pending.future.done()
                pending.future.cancel()  # not sent yet: never sent (no backlog after a stall)
                return 0, False
            return None, False  # not determined yet: vLLM asks again at its next step
        del self._pending[rid]
        found = self._lookups[rid] = found.at_local(num_computed_tokens)
        if time.monotonic() - found.at >= LOOKUP_REUSE_S:
            # made when the request arrived, and it has queued since: served now (the request
            # is at the queue's head), refreshed in the background for the asks to come, and
            # its chunks below DRAM promoted while it waits for blocks
            if not self._calls.stalled(self.lookup_deadline_s):
                self._submit(rid, request, n, num_computed_tokens, time.monotonic())
            self._promote_waiting(rid, found)
        return self._external(found, num_computed_tokens)

    def _fits(self, request, num_computed_tokens: int) -> bool:  # type: ignore[no-untyped-def]
        """Whether vLLM's pool has free blocks for all of the request's tokens past
        ``num_computed_tokens`` now (False when vLLM bound no pool)."""
        pool = self.block_pool
        if pool is None:
            return False
        try:
            free = int(pool.get_num_free_blocks())
        except Exception:  # noqa: BLE001 (another vLLM's pool: no waits while busy, as without one)
            return False
        need = -(-len(request.all_token_ids) // self.block_size) - num_computed_tokens // self.block_size
        return free >= need

    def _external(self, found: _Lookup, num_computed_tokens: int) -> tuple[int, bool]:
        external = max(0, found.chunks * self.chunk + found.tail * self.block_size - num_computed_tokens)
        return external, self.load_async and external > 0

    def _submit(self, rid: str, request, n: int, num_computed_tokens: int, now: float) -> _Pending:  # type: ignore[no-untyped-def]
        tokens = list(request.all_token_ids)
        self.lookups_sent += 1
        future = self._calls.submit(lambda: self._lookup(request, tokens, n, num_computed_tokens))
        pending = self._pending[rid] = _Pending(future, n, num_computed_tokens, now)
        return pending

    @staticmethod
    def _result(future: Future) -> _Lookup | None:
        """A done lookup's answer; None if it failed."""
        if future.cancelled() or future.exception(timeout=0) is not None:
            return None
        return future.result(timeout=0)

    def _forget_pending(self, rid: str) -> None:
        """Drop the request's lookup in flight, unsent if it is still queued."""
        pending = self._pending.pop(rid, None)
        if pending is not None:
            pending.future.cancel()

    def _lookup(self, request, tokens: list[int], n: int, num_computed_tokens: int) -> _Lookup:  # type: ignore[no-untyped-def]
        """The daemon's answer for ``tokens[:n]`` (on the lookups' thread)."""
        keys = self._full_keys(request, tokens[:n])
        tiers = self.client.lookup_keys(keys, num_tokens=n, request=str(request.request_id))
        m = len(tiers)
        tail = 0
        room = min(self.per_chunk - 1, (n - m * self.chunk) // self.block_size)
        if room > 0 and m * self.chunk + room * self.block_size > num_computed_tokens:
            sizes = list(range(room, 0, -1))
            candidates = [self._tail_key(request, keys, tokens, m, k) for k in sizes]
            held = self.client.probe(candidates, remote=True)  # (another machine's tail too)
            tail = next((k for k, t in zip(sizes, held, strict=True) if t is not None), 0)
            if tail:
                keys = [*keys[:m], candidates[sizes.index(tail)]]
                tiers = [*tiers, str(held[sizes.index(tail)])]
        return _Lookup(keys[: m + (1 if tail else 0)], m, tail, num_computed_tokens, n, tiers, time.monotonic())

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
        meta = KVTierMetadata(loads=self._loads, finishes=self._finishes)
        self._loads, self._finishes = [], []
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
                meta.saves.append(Transfer(rid, keys[tr.stored :], tr.stored, tr.block_ids[: full * self.per_chunk]))
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
                                       tail_blocks=tail))
        return True

    def update_connector_output(self, output) -> None:  # type: ignore[no-untyped-def]
        """A step's outcome from the workers: a request whose load failed (vLLM recomputes the
        blocks) is not offered kvtier's chunks again -- a load that fails for good (a rank that
        lacks its shard, a worker that is disabled) must not be retried forever; a save a
        worker skipped because the daemon was slow is planned again (its blocks still hold it:
        the request runs, or is finishing with its blocks kept)."""
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVTierWorkerMeta):
            for rid, first in meta.unsaved.items():  # saves a worker skipped: planned again
                tr = self._tracked.get(rid)
                if tr is not None and first < tr.stored:
                    tr.stored = first
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

    # -- cache reset, events, counters --------------------------------------------------------
    def reset_cache(self) -> bool:
        """vLLM reset its prefix cache (``/reset_prefix_cache?reset_external=true``;
        ``pause_generation(clear_cache=True)``: new weights): from now on no load is served
        from a chunk saved before. A new epoch is chained into every key; answers and
        promotions made before are dropped; requests admitted before save nothing more unless
        they are computed again from the start (preempted, then resumed); every chunk
        announced in KV events is removed. vLLM resets its own cache first: when that failed
        (blocks were held -- vLLM then returns False, and the caller must retry), requests
        admitted over vLLM's local hits are not saved until a reset succeeds, since those hits
        may be the old weights'. Runs on vLLM's engine thread between steps; the daemon is not
        asked (the old chunks age out), so kvtier's part cannot fail."""
        self.epoch = secrets.token_bytes(16)
        pool = self.block_pool
        try:  # (vLLM's own test: every block but the null one free)
            self._gpu_stale = pool is None or int(pool.num_gpu_blocks) - int(pool.get_num_free_blocks()) != 1
        except Exception:  # noqa: BLE001 - unknown: assume the worst
            self._gpu_stale = True
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
                                    "hints_dropped": self.hints_dropped}
        counts.update({HIT_PREFIX + tier: n for tier, n in self.hit_tokens.items()})
        return counts, {"save_backlog_requests": len(self._freeing)}

    def phase(self, req_id: str) -> Phase | None:
        tr = self._tracked.get(req_id)
        return None if tr is None else tr.phase

    # -- hints ---------------------------------------------------------------------------------
    def on_new_request(self, request) -> None:  # type: ignore[no-untyped-def]
        """The daemon's policies hear of the waiting request (AttentionStore's look-ahead window)
        and its chunks move SSD -> DRAM while it waits in the queue."""
        if skipped(request):
            return
        rid, tokens = str(request.request_id), list(request.all_token_ids)[:-1]
        self._hint_later(self._queued, request, rid, tokens)
        # its lookup goes out now, for no local tokens (it serves any local hit vLLM then
        # finds: :func:`_serves`): by the step that first asks, the answer is most often back,
        # and no running request's step waits for it
        n = len(tokens)
        if n >= self.block_size and rid not in self._pending and rid not in self._lookups \
                and not self._calls.stalled(self.lookup_deadline_s) and self._calls.pending < MAX_PENDING_LOOKUPS:
            self._submit(rid, request, n, 0, time.monotonic())

    def _promote_waiting(self, rid: str, found: _Lookup) -> None:
        """A request vLLM asks about again waits for blocks at the head of its queue: its
        chunks below DRAM are promoted into DRAM now, once, in the background, so the step that
        loads it reads DRAM instead of waiting for SSD (the hint made when it arrived is
        spent on every queued request alike, and most of what it brings up is evicted again
        before the request is served)."""
        first = found.local // self.chunk  # (chunks vLLM holds itself are not loaded)
        tiers = found.tiers[first : found.chunks]  # (full chunks: a tail promotes with its load)
        if rid in self._promoted or all(t == "host" for t in tiers):
            return
        if self._hint_later(self._prefetch, found.keys[first : found.chunks], first, rid):
            self._promoted.add(rid)

    def _prefetch(self, keys: list[ChunkKey], first: int, rid: str) -> None:
        try:
            self._hint_client.prefetch(keys, first=first, request=rid)
        except DaemonUnavailable:
            pass
        except Exception:
            log.exception("kvtier: prefetch hint failed")

    def _hint_later(self, fn, *args) -> bool:  # type: ignore[no-untyped-def]
        """Send a hint on the hints' thread; dropped (counted, False) while :data:`MAX_HINTS`
        wait."""
        with self._hint_lock:
            if self._hints_waiting >= MAX_HINTS:
                self.hints_dropped += 1
                return False
            self._hints_waiting += 1

        def send() -> None:
            try:
                fn(*args)
            finally:
                with self._hint_lock:
                    self._hints_waiting -= 1

        self._hints.submit(send)
        return True

    def _queued(self, request, rid: str, tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
        try:
            # (no prefetch now: its chunks are promoted when it waits at the queue's head,
            # :meth:`_promote_waiting` -- promoted now, a long queue's arrivals would evict
            # the chunks of the requests ahead of them, which are served first)
            self._hint_client.queued(rid, self._full_keys(request, tokens), prefetch=False)
        except DaemonUnavailable:
            pass
        except Exception:  # a hint must never take the scheduler down
            log.exception("kvtier: queued hint failed")

    def _hint(self, what: str, rid: str) -> None:
        try:
            getattr(self._hint_client, what)(rid)
        except DaemonUnavailable:
            pass
        except Exception:
            log.exception("kvtier: %s hint failed", what)

    def close(self) -> None:
        self._hints.shutdown(wait=False)
        self._calls.close(wait=False)
