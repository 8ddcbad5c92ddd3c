"""``returns``: keep the conversations that come back soonest, and stage them before they do.

A conversation's next turn comes after a think time, and think times can be learned: per
session from its own earlier gaps, and across sessions online. This policy predicts when each
session is used next, evicts the chunks of the sessions expected farthest in the future (one
long overdue is probably over and goes first), and asks the store to bring a session back into
DRAM shortly before it is due (:meth:`ReturnsPolicy.staging`).

**Sessions without session ids.** Prefix families stand in for sessions. A touch of a sequence
from its first chunk continues a known session when it holds that session's last-seen deepest
key (a new turn's prompt extends the previous prompt and reply), or the key before it when the
session owned that one (the deepest was a partial last block, which the next prompt re-keys);
the deepest such key wins. A sequence that matches none and ends in a key never seen starts a
new session; the first key is never the session id, so a shared system prompt does not make
two sessions one. A chunk that a second session touches (a shared system prompt or document)
becomes a group of its own, whose uses are all its users'. At most ``MAX_SESSIONS`` sessions
are remembered (the least recently used are forgotten, their chunks evicted first).

**Uses.** A touch that extends its session's latest sequence is a use of it, once per request
(``use``/``begin`` as in :mod:`~kvtier.core.policies.base`); times are the ``now`` of
``begin`` (without a scheduler ``time.monotonic()``, each touch a use of its own, uses closer
than ``MIN_GAP_S`` one use). A touch that only repeats a known prefix is the request's *claim*
when it is the request's first: its session ranks as used now until the request's save shows
whose request it is (so making room for that save does not evict the session being served),
and it counts as a use only if no extension follows (a prompt seen before). Later such touches
in the request are other sessions' prefetches (a staging), not uses; nor is the prefetch of a
queued request (its keys as hinted).

**Think times.** A session's gap is its *think time proper* when the scheduler says when each
request arrived (``hint`` with its arrival, :meth:`ReturnsPolicy.arrived`) and when its reply
was done (:meth:`ReturnsPolicy.finished`): the next turn's arrival less the previous reply's
end. Otherwise (a request served without being queued, a store without those hooks) it is the
time between the two requests' starts, which also holds both turns' queueing: behind a deep
queue that gap is mostly the queue's, and memoryless think times then look regular (measured on
ShareGPT sessions in a closed loop, 13B at AttentionStore's capacities: with start gaps
``returns`` saved 0.90x of ``attentionstore``'s prefill with exponential think times and 0.96x
with fixed ones; with the think time proper 1.00x and 1.19x). A session's predictions count from
that reply (:attr:`_Group.anchor`), and a regular one is staged for when its next request is
expected to *start*: its arrival plus the queue's mean wait (learned from arrivals and starts),
and not at all when that is after it would be over (a queue longer than its lead and slack): it
is queued by then, and the queue's prefetch brings it in. Staged for its arrival, a session
waiting behind a deep queue holds DRAM the queue's head needs.

**Return times.** A group's gap is the mean of its own gaps, shrunk towards the cross-session
mean (a running mean of all sessions' gaps over about ``GLOBAL_WINDOW`` of them; ``GAP_PRIOR_S``
before the first) with the weight of ``PRIOR_GAPS`` gaps. Whether it comes back at all, ``p``,
is learned per class of groups (see :class:`_Again`). Its think times are *regular* when the
variance of their logs (its own, shrunk towards the within-session variance of all sessions,
which starts at an exponential's) is under ``REGULAR_LOG_VAR``. A regular group's next use is
expected at ``last + gap / p``, so the group just used is the farthest (with regular returns
LRU is the wrong order); an irregular one's at ``now + max(gap, now - last) / p`` (memoryless or
heavier tailed: the longer away, the longer still). A group is *over* once its gap is
``OVER_Z`` deviations overdue (at most ``OVER_FACTOR`` gaps).

**Eviction**, from lazy heaps of groups: chunks of forgotten sessions first, then of groups
over (the longest over first), then of the group expected farthest (regular groups kept in
order of that time, irregular ones of ``last - gap / p``, the two tops compared at ``now``);
within a group the chunks its latest use did not touch, then the deepest (a chunk without its
prefix can never hit). As in ``attentionstore``, chunks that queued requests need are kept (the
farthest needed goes only if every candidate is needed) and the scheduler prefetches them;
like it, the policy hears of the whole queue (``lookahead``). A chunk put into DRAM and not touched yet goes last.

**Staging** (regular sessions, DRAM). A session enters its staging window ``lead = max(
MIN_LEAD_S, LEAD_SHARE x gap)`` before it is due: the lead scales with the gap since the error
of a prediction does, and leaves time for the prefetch from SSD (measured on ShareGPT sessions
with a fixed think time at a quarter of AttentionStore's capacities: half a gap saves 5.7% of
prefill, a quarter 3.9%, a whole gap no more than half). In its window :meth:`staging` returns
its latest sequence once DRAM holds enough chunks expected *farther* than it for what it lacks,
the prefix that fits if not all: staging only evicts those (never a session due sooner). A
session whose staged chunks are evicted before its turn waits to be staged again. Nothing is
staged while requests are queued: a session that comes back then waits behind them, and the
queue's prefetch (on arrival, and as the window reaches it) brings it in; staged earlier it
only takes DRAM from the queue's head (ShareGPT sessions, 13B at the paper's capacity: 60.1%
of prefill saved staging regardless, 61.3% not behind a queue; of all the chunks prefetched,
the queue's included, the share a lookup then found went from 31% to 84%). The queue is the
store's, all its engines': one engine's queue holds staging back for an idle one sharing the
store too.

**Admission.** DRAM admits everything. A lower tier admits a chunk when a hit on it there saves
prefill time (its recompute takes longer than reading it from there; a live store, which knows
neither the model's speed nor the tier's, admits every chunk), and otherwise only for a
session regular enough for staging to bring it back into DRAM in time (log variance under
``ADMIT_LOG_VAR``): a hit from a tier slower than recompute is a loss, and the tier is then
only worth it as a staging area.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.attentionstore import QUEUE_LOOKAHEAD
from kvtier.core.policies.base import EvictionPolicy, TierContext
from kvtier.core.policies.returns_heaps import ReturnsHeaps, _Slot
from kvtier.core.policies.returns_model import (
    ADMIT_LOG_VAR,
    GAP_PRIOR_S,
    LOG_VAR_PRIOR,
    MAX_CHUNKS,
    MAX_SESSIONS,
    MIN_GAP_S,
    ReturnsModel,
    Sig,
    _Again,
    _bounded,
    _Chunk,
    _Group,
    _Mean,
)
from kvtier.core.policies.window import QueueWindow


class ReturnsPolicy(ReturnsModel, ReturnsHeaps, EvictionPolicy):
    lookahead = QUEUE_LOOKAHEAD

    def __init__(self, context: TierContext | None = None) -> None:
        self._ctx = context or TierContext()
        self._meta: OrderedDict[ChunkKey, _Chunk] = OrderedDict()
        self._resident: dict[ChunkKey, _Slot] = {}
        self._fresh: OrderedDict[ChunkKey, None] = OrderedDict()
        self._orphans: OrderedDict[ChunkKey, None] = OrderedDict()
        self._sessions: OrderedDict[int, _Group] = OrderedDict()
        self._ids = itertools.count()
        self._tails: dict[ChunkKey, _Group] = {}
        self._regular: list[tuple[float, int, int, _Group, int]] = []  # (-expected, -depth, tie, g, v)
        self._irregular: list[tuple[float, int, int, _Group, int]] = []  # (last - gap/p, ...)
        self._by_over: list[tuple[float, int, int, _Group, int]] = []
        self._to_stage: list[tuple[float, int, _Group, int]] = []  # (stage at, tie, g, uses)
        self._open: list[tuple[float, int, _Group, int]] = []  # (over at, tie, g, uses)
        self._waiting: dict[_Group, None] = {}  # sessions in their staging window
        self._tie = itertools.count()
        self._live = 0  # groups with resident chunks
        self._again = (_Again(), _Again())  # shared chunks, sessions
        self._gap = _Mean(GAP_PRIOR_S)
        self._log_var = _Mean(LOG_VAR_PRIOR)
        self._window = QueueWindow()
        self._queued: dict[int, Sig] = {}  # queued request -> its keys' signature
        self._echoes: dict[Sig, int] = {}
        self._claims: dict[int, tuple[_Group, float, Sequence[ChunkKey]]] = {}
        self._unclaimed: dict[int, tuple[float, Sequence[ChunkKey]]] = {}
        self._extended: dict[int, _Group] = {}  # requests that extended a session
        self._begun: OrderedDict[int, float] = OrderedDict()
        self._serving: OrderedDict[int, _Group] = OrderedDict()  # request -> the session it used
        self._replied: OrderedDict[int, float] = OrderedDict()  # request -> when its reply was done
        self._arrivals: OrderedDict[int, float] = OrderedDict()  # queued request -> its arrival
        self._wait = _Mean(0.0)  # how long a queued request waits to start
        self._scheduled = False
        self._pressed = False  # the tier has had to evict: it is full
        self._seq, self._now = -1, 0.0
        self._clock = itertools.count()

    # -- scheduler hooks ----------------------------------------------------------------------
    def begin(self, seq: int, now: float) -> None:
        self._settle()
        self._close(now)
        self._scheduled = True
        self._seq, self._now = seq, now
        _bounded(self._begun, seq, now)
        arrival = self._arrivals.pop(seq, None)
        if arrival is not None and now >= arrival:
            self._wait.add(now - arrival)
        self._window.leave_through(seq)
        for done in [s for s in self._queued if s <= seq]:
            sig = self._queued.pop(done)
            left = self._echoes.pop(sig) - 1
            if left:
                self._echoes[sig] = left

    def hint(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        self._window.join(seq, keys)
        if keys and seq not in self._queued:
            sig = self._queued[seq] = (len(keys), keys[0], keys[-1])
            self._echoes[sig] = self._echoes.get(sig, 0) + 1

    def arrived(self, seq: int, keys: Sequence[ChunkKey], now: float) -> None:
        """A queued request arrived ``now``. One that continues a session gives its think time
        proper: this long after the reply to the session's last request (:meth:`finished`).
        Gaps between request starts also hold both turns' queueing, which behind a deep queue
        makes memoryless think times look regular. The first arrival of a request announced
        twice counts. (Marking the session back, neither over nor staged while it waits, was
        measured worse: ShareGPT sessions with per-session think times, 13B at the paper's
        capacity, saved 50.8% of prefill against 55.7% without.)"""
        if not keys or seq in self._arrivals:
            return
        _bounded(self._arrivals, seq, now)
        g = self._match(keys)
        if g is None or not g.session or g.forgotten:
            return
        if g.replied is not None and g.served != seq and now >= g.replied:
            g.think = (seq, max(MIN_GAP_S, now - g.replied))

    def finished(self, seq: int, now: float) -> None:
        """Request ``seq``'s reply was done: its session's next turn is expected a think time
        after this, and its gap counts from here."""
        _bounded(self._replied, seq, now)  # for a use of it that comes later (a save after the end)
        g = self._serving.get(seq)
        if g is None or g.served != seq or g.forgotten:
            return
        g.replied = now
        self._rank(g)
        self._plan(g)  # (a session already in the window of its earlier plan stays there:
        # dropping it lost 1.2 points of prefill saved with fixed think times, 13B)

    # -- sessions -----------------------------------------------------------------------------
    def _match(self, keys: Sequence[ChunkKey]) -> _Group | None:
        """The session whose last-seen sequence ``keys`` extends (the deepest match)."""
        tails = self._tails
        for i in range(len(keys) - 1, -1, -1):
            g = tails.get(keys[i])
            if g is not None:
                return g
        return None

    def _session_of(self, keys: Sequence[ChunkKey]) -> _Group | None:
        g = self._match(keys)
        if g is not None:
            return g
        if keys[-1] in self._meta:
            return None  # a prefix of something known
        g = _Group(session=True, sid=next(self._ids))
        self._sessions[g.sid] = g
        while len(self._sessions) > MAX_SESSIONS:
            self._forget(self._sessions.popitem(last=False)[1])
        return g

    def _forget(self, g: _Group) -> None:
        g.forgotten = True
        for key in g.tails:
            if self._tails.get(key) is g:
                del self._tails[key]
        for *_, tie, key in list(g.heap):
            slot = self._resident.get(key)
            if slot is not None and slot.group is g and slot.tie == tie:
                self._place(key, None)
        g.heap.clear()

    def _remember(self, g: _Group, keys: Sequence[ChunkKey]) -> None:
        """``keys`` is ``g``'s latest sequence: its deepest key, and the one before it when
        ``g`` owns that one, name the session from now on."""
        tails = self._tails
        for key in g.tails:
            if tails.get(key) is g:
                del tails[key]
        g.keys = tuple(keys)
        before = self._meta.get(keys[-2]) if len(keys) > 1 else None
        g.tails = (keys[-1], keys[-2]) if before is not None and before.group is g else (keys[-1],)
        for key in g.tails:
            tails[key] = g

    # -- EvictionPolicy -----------------------------------------------------------------------
    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        if not keys:
            return
        when = self._when(use)
        if when is None:
            return
        if start != 0:  # a run from the middle (a chunk recovered alone): its group, if known
            for key in keys:
                self._requeue_chunk(key)
            return
        epoch, now = when
        if (len(keys), keys[0], keys[-1]) in self._echoes:  # a queued request's prefetch
            self._adopt(keys)
            return
        g = self._session_of(keys)
        if g is None or g.prefix(keys):
            self._known(g, keys, epoch, now)
            return
        claim = self._claims.pop(epoch, None)
        if claim is not None:
            self._unclaim(claim[0])
        if self._scheduled:
            self._extended[epoch] = g
        rekey = g.epoch == epoch  # the same request extends what it saved: a re-key, not a sibling
        self._use(g, epoch, now, len(keys) > 1)
        metas = self._meta
        for pos, key in enumerate(keys):
            meta = metas.get(key)
            if meta is None:
                metas[key] = _Chunk(g, pos, g.uses)
            else:
                owner = meta.group
                if owner.forgotten:
                    meta.group = owner = g
                elif owner is not g:
                    if owner.session:  # a second session: the chunk becomes a group of its own
                        meta.group = owner = _Group(session=False, depth=pos, last=owner.last, uses=1)
                    self._use(owner, epoch, now)
                meta.position, meta.stamp, meta.dead = pos, owner.uses, False
                metas.move_to_end(key)
            self._requeue_chunk(key)
        if rekey:
            self._supersede(g, keys)
        self._remember(g, keys)
        while len(metas) > MAX_CHUNKS + len(self._resident):
            metas.popitem(last=False)

    def _supersede(self, g: _Group, keys: Sequence[ChunkKey]) -> None:
        """``keys``, saved by the request that saved ``g``'s previous sequence, extends it past
        its deepest chunk: that chunk, re-keyed at its position (the partial last block of the
        prompt that the reply completes), is dead for ``g`` and goes with the orphans, first
        out, and no lower tier admits it. Only within one request (a later request that matches
        ``g`` by prefix may be another session sharing it, whose chunk at that position is
        live), only when the rest of the previous sequence is a prefix of ``keys`` and ``keys``
        is longer, and only a chunk ``g`` owns alone. Its metadata stays: a later touch (the
        same prompt again, a regenerated reply) ranks it back in its group."""
        old = g.keys
        n = len(old)
        if n == 0 or len(keys) <= n or keys[n - 1] == old[-1] or tuple(keys[: n - 1]) != old[:-1]:
            return
        key = old[-1]
        meta = self._meta.get(key)
        if meta is None or meta.group is not g or meta.position != n - 1:
            return
        meta.dead = True
        if key in self._resident:
            self._place(key, None)

    def _known(self, g: _Group | None, keys: Sequence[ChunkKey], epoch: int, now: float) -> None:
        """A touch of a sequence all known that extends no session (``g``: the session it
        matched, if any)."""
        self._adopt(keys)
        if not self._scheduled:
            self._used(keys, epoch, now)
            return
        if epoch in self._extended or epoch in self._claims:
            return  # the request is known: another session's prefetch, or a staging
        if g is None:
            meta = self._meta.get(keys[-1])
            g = meta.group if meta is not None and meta.group.session else None
        if g is not None and g.prefix(keys) and not g.forgotten:
            self._claim(g, epoch, now, keys)
        elif len(keys) > len(self._unclaimed.get(epoch, (0.0, ()))[1]):
            self._unclaimed[epoch] = (now, keys)

    def _adopt(self, keys: Sequence[ChunkKey]) -> None:
        """Chunks of ``keys`` inserted and not ranked yet get their group; one never seen
        (saved again inside a known sequence) joins that of the deepest known chunk."""
        fresh = self._fresh
        if not fresh or not any(key in fresh for key in keys):
            return
        owner = next((m.group for m in map(self._meta.get, reversed(keys))
                      if m is not None and not m.group.forgotten), None)
        for pos, key in enumerate(keys):
            if key in fresh:
                if owner is not None and key not in self._meta:
                    self._meta[key] = _Chunk(owner, pos, owner.uses)
                self._requeue_chunk(key)

    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        if key in self._resident:
            return
        self._resident[key] = _Slot(None, -1)
        meta = self._meta.get(key)
        if meta is not None:
            meta.group.arrived += 1
        if self._ctx.level == 0 or meta is None:
            # saved or promoted into DRAM: the touch that follows ranks it (until then its
            # group's rank may be stale: the request using it has not been seen yet)
            self._fresh[key] = None
        else:
            self._requeue_chunk(key)  # demoted: no touch follows

    def admit(self, key: ChunkKey, position: int | None) -> bool:
        """DRAM admits everything. A lower tier admits a chunk when a hit on it from there saves
        prefill time, or when its session is regular and not over: staging will bring it back
        into DRAM before its turn. Otherwise a hit from there would take longer than
        recomputing the chunk, so it is better not kept there."""
        if self._ctx.level == 0:
            return True
        meta = self._meta.get(key)
        if meta is not None and meta.dead:
            return False  # superseded: only the same prompt again would read it
        at = position if position is not None else meta.position if meta is not None else 0
        if self._ctx.miss_saving_s(at) > 0:
            return True
        if meta is None or meta.group.forgotten:
            return False
        g = meta.group
        return (g.session and g.regular and g.var < ADMIT_LOG_VAR
                and (self._now if self._scheduled else time.monotonic()) < g.over)

    def remove(self, key: ChunkKey) -> None:
        slot = self._resident.pop(key, None)
        if slot is None:
            return
        self._unplace(key, slot)
        g = slot.group
        if g is not None and g.staged == g.uses and g.held is None:  # staged, evicted before its turn
            g.staged = -1
            self._waiting[g] = None

    def __len__(self) -> int:
        return len(self._resident)
