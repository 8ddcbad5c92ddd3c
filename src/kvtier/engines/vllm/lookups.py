"""The scheduler half's lookups: what kvtier holds for a request, asked of the daemon without
holding vLLM's engine loop up for long.

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
loads it does not wait for SSD (:mod:`.hints`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from kvtier.core.keys import ChunkKey
from kvtier.engines.vllm.request_state import skipped

MAX_PENDING_LOOKUPS = 4096
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


class Lookups:
    """:class:`~.scheduler.SchedulerSide`'s lookups (a mixin: its state is the scheduler half's,
    set up in ``SchedulerSide.__init__``)."""

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
