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
prefill time (its recompute takes longer than reading it from there), and otherwise only for a
session regular enough for staging to bring it back into DRAM in time (log variance under
``ADMIT_LOG_VAR``): a hit from a tier slower than recompute is a loss, and the tier is then
only worth it as a staging area.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.attentionstore import QUEUE_LOOKAHEAD
from kvtier.core.policies.base import EvictionPolicy, TierContext
from kvtier.core.policies.window import QueueWindow

GAP_PRIOR_S = 60.0
"""The cross-session gap before any gap is seen (a chat user's think time)."""
GLOBAL_WINDOW = 1000
PRIOR_GAPS = 1.0
LOG_VAR_PRIOR = math.pi ** 2 / 6
"""Variance of the log of an exponential think time: irregular until shown otherwise."""
REGULAR_LOG_VAR = 0.5
"""Between gamma think times of shape 2 (0.64) and 3 (0.39); a fixed think time has 0."""
ADMIT_LOG_VAR = 0.1
"""Measured on ShareGPT sessions at AttentionStore's capacities, where an SSD hit takes 4x a
recompute: sessions with a fixed think time (log variance about 0) are staged in time for 98%
of their hits, and admitting them to SSD pays; with per-session gamma think times of shape 4
(0.28) only 36% are, and admitting them at 0.5 saved -77% of prefill, at 0.25 -38%, at 0.1
(none admitted) +7%."""
OVER_FACTOR = 3.0
"""At most this many gaps after its last use a group is over."""
OVER_Z = 2.0
"""A group is over once its gap is this many standard deviations (of its log gaps) overdue: for
lognormal gaps, the 98th percentile of its gap (3.6 gaps for an exponential's spread, capped at
``OVER_FACTOR``; 2.3 for a gamma of shape 4; about 1 for a fixed think time)."""
LEAD_SHARE = 0.5
MIN_LEAD_S = 1.0
MIN_GAP_S = 1.0
MAX_USES = 4
MAX_SESSIONS = 1 << 16
MAX_CHUNKS = 1 << 20
"""Chunks remembered (group, position) beyond those resident; the oldest are forgotten."""
MAX_BEGUN = 1 << 12
"""Requests remembered: start times (for touches that name their request), arrivals and the
session each used (for the think time)."""
BUDGET_SCAN = 16
"""Groups looked at, farthest first, to size what one staging may evict."""

Sig = tuple[int, ChunkKey, ChunkKey]
INF = float("inf")


@dataclass(slots=True, eq=False)
class _Group:
    """A session, or one chunk shared by several sessions (``session`` False)."""

    session: bool
    sid: int = -1
    depth: int = 0
    """A shared chunk's position (among equals the deepest goes first)."""
    last: float = 0.0
    epoch: int | None = None
    uses: int = 0
    gap_sum: float = 0.0
    gaps: int = 0
    log_mean: float = 0.0
    log_m2: float = 0.0
    gap: float = 0.0
    p: float = 1.0
    var: float = LOG_VAR_PRIOR
    """The variance of the logs of its gaps (shrunk towards all sessions')."""
    regular: bool = False
    due: float = 0.0
    slack: float = OVER_FACTOR
    """Gaps after its last use when it is over."""
    over: float = 0.0
    stage_at: float = INF
    cls: int | None = None
    """Its class for :class:`_Again` at its last use."""
    ended: int = -1
    """The use counted as over without a return."""
    version: int = 0
    resident: int = 0
    heap: list[tuple[int, int, int, ChunkKey]] = field(default_factory=list)
    """Resident chunks: (stamp, -position, tie, key), the least recently touched by the group
    first, then the deepest; stale entries are skipped."""
    keys: tuple[ChunkKey, ...] = ()
    """A session's latest sequence (prefix order)."""
    tails: tuple[ChunkKey, ...] = ()
    staged: int = -1
    """The use count a staging was last returned for."""
    arrived: int = 0
    """Its chunks put into DRAM so far."""
    tried: tuple[int, int] | None = None
    """(use count, arrived) when a staging last returned it."""
    held: float | None = None
    """Its last use while a request claims it (see ``_claim``)."""
    served: int = -1
    """The request of its last use (whose reply its next turn answers)."""
    replied: float | None = None
    """When the reply to that request was done (:meth:`ReturnsPolicy.finished`)."""
    think: tuple[int, float] | None = None
    """(request, think time): the session's next request arrived this long after the reply
    to its last one; that request's use takes it as the gap."""
    forgotten: bool = False

    @property
    def anchor(self) -> float:
        """What its gap counts from: the reply to its last request when known, else that
        request's start."""
        replied = self.replied
        return replied if replied is not None and replied > self.last else self.last

    def expected(self, now: float) -> float:
        """When its next use is expected, seen from ``now``."""
        if self.regular:
            return self.anchor + self.gap / self.p
        return now + max(self.gap, now - self.anchor) / self.p

    def prefix(self, keys: Sequence[ChunkKey]) -> bool:
        """Whether ``keys`` is a prefix of its latest sequence."""
        n = len(keys)
        return n <= len(self.keys) and self.keys[n - 1] == keys[-1]


@dataclass(slots=True)
class _Chunk:
    group: _Group
    position: int
    stamp: int
    """Its group's use count when the group last touched it."""
    dead: bool = False
    """Superseded in its session (see ``_supersede``) and not touched since."""


@dataclass(slots=True)
class _Slot:
    """Where a resident chunk is queued: a group's heap (entry ``tie``), or none (orphan,
    fresh)."""

    group: _Group | None
    tie: int
    stamp: int = 0


class _Again:
    """P(a group is used again | its class), counted online over the uses whose outcome is
    known: used again, or over without (a use still open would bias the odds down). The class
    is the use count so far (1, 2, 3, 4+) and whether its latest sequence has more than one
    chunk: a one-chunk prompt is a partial block, which the next turn's prompt does not repeat,
    so by keys that "session" never continues (a short first turn) and must not lower the odds
    of the others."""

    def __init__(self) -> None:
        self._seen = [0] * (2 * MAX_USES + 2)
        self._again = [0] * (2 * MAX_USES + 2)

    @staticmethod
    def of(uses: int, wide: bool) -> int:
        return 2 * min(uses, MAX_USES) + wide

    def returned(self, cls: int, counted: bool) -> None:
        """Used again; ``counted``: already counted as over (it came back late)."""
        self._again[cls] += 1
        self._seen[cls] += not counted

    def ended(self, cls: int) -> None:
        self._seen[cls] += 1

    def p(self, cls: int) -> float:
        """Smoothed towards the odds of all classes of its width (two uses' worth)."""
        width = slice(cls % 2, None, 2)
        pooled = (sum(self._again[width]) + 1) / (sum(self._seen[width]) + 2)
        return (self._again[cls] + 2 * pooled) / (self._seen[cls] + 2)


def _bounded(requests: OrderedDict, seq: int, value: object) -> None:
    """``requests[seq] = value``, the oldest forgotten past ``MAX_BEGUN``."""
    requests[seq] = value
    while len(requests) > MAX_BEGUN:
        requests.popitem(last=False)


class _Mean:
    """An exponentially weighted mean over about ``GLOBAL_WINDOW`` samples."""

    def __init__(self, prior: float) -> None:
        self.value, self._n = prior, 0

    def add(self, x: float) -> None:
        self._n += 1
        self.value += (x - self.value) / min(self._n, GLOBAL_WINDOW)


class ReturnsPolicy(EvictionPolicy):
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

    def staging(self, now: float) -> list[Sequence[ChunkKey]]:
        """Regular sessions within their lead of their expected return and not in DRAM for
        it, as their latest sequences (prefix order), soonest expected first; each only as far
        as DRAM holds chunks expected farther than it (see the module docstring). A session
        whose staged chunks are evicted before it comes back waits to be staged again. None
        while a request is queued (announced with ``hint`` and not begun)."""
        heap, waiting = self._to_stage, self._waiting
        while heap and heap[0][0] <= now:
            at, _, g, uses = heapq.heappop(heap)
            if g.uses == uses and g.stage_at == at:
                waiting[g] = None
        for g in [g for g in waiting if g.forgotten or g.staged == g.uses or now >= g.over
                  or not g.regular]:
            del waiting[g]
        if not waiting or self._queued:
            return []  # behind a queue a session is prefetched as the queue's own (see above)
        farther = self._farther(now) if self._pressed else [(INF, 1 << 62)]
        out: list[Sequence[ChunkKey]] = []
        for g in sorted(waiting, key=lambda g: g.expected(now)):
            if g.held is not None:
                continue  # being served
            mine = g.expected(now)
            if not farther or farther[-1][0] <= mine:
                break  # DRAM holds nothing expected later than this one, or the next ones
            missing = [i for i, key in enumerate(g.keys) if key not in self._resident]
            if g.tried == (g.uses, g.arrived):
                missing = []  # the last staging brought none of it: not held below
            budget = 0
            while missing and farther and farther[-1][0] > mine and budget < len(missing):
                budget += farther.pop()[1]
            if budget >= len(missing):
                g.staged = g.uses
                del waiting[g]
            if missing and budget:
                out.append(g.keys if budget >= len(missing) else g.keys[: missing[budget]])
                g.tried = (g.uses, g.arrived)
        return out

    def _farther(self, now: float) -> list[tuple[float, int]]:
        """(expected next use, resident chunks) of the groups evicted first, ascending:
        orphans and over groups at infinity, then up to ``BUDGET_SCAN`` of each heap."""
        first = len(self._orphans) + sum(e[3].resident for e in self._tops(self._by_over, now))
        out = sorted((e[3].expected(now), e[3].resident)
                     for heap in (self._regular, self._irregular) for e in self._tops(heap)
                     if now < e[3].over)
        out.append((INF, first))
        return out

    def _tops(self, heap: list, over: float | None = None) -> list[tuple]:
        """Up to ``BUDGET_SCAN`` valid entries from the top of ``heap``, in order (left in it);
        with ``over``, only those of ``_by_over`` over by then."""
        out: list[tuple] = []
        while heap and len(out) < BUDGET_SCAN:
            entry = heapq.heappop(heap)
            if self._live_entry(entry):
                out.append(entry)
                if over is not None and entry[0] > over:
                    break
        for entry in out:
            heapq.heappush(heap, entry)
        return out if over is None or not out or out[-1][0] <= over else out[:-1]

    # -- time and uses ------------------------------------------------------------------------
    def _when(self, use: int | None) -> tuple[int, float] | None:
        """(request, time) of a touch; None for a queued request's (a prefetch, not a use)."""
        if not self._scheduled:
            return (use if use is not None else -2 - next(self._clock)), time.monotonic()
        if use is None:
            return self._seq, self._now
        if use in self._queued:
            return None
        return use, self._begun.get(use, self._now)

    def _use(self, g: _Group, epoch: int, now: float, wide: bool = True) -> None:
        if g.epoch == epoch:
            return
        if g.held is not None:  # claimed by another request: this use decides
            g.last, g.held = g.held, None
        if not self._scheduled and g.uses and now - g.last < MIN_GAP_S:
            g.epoch = epoch  # the lookup, load and save of one request, unnumbered
            return
        think, g.think = g.think, None
        gap = think[1] if think is not None and think[0] == epoch else now - g.last
        if g.uses and gap > 0:
            g.gap_sum += gap
            g.gaps += 1
            delta = math.log(gap) - g.log_mean
            g.log_mean += delta / g.gaps
            step = delta * (math.log(gap) - g.log_mean)
            g.log_m2 += step
            if g.session:
                self._gap.add(gap)
                if g.gaps > 1:
                    self._log_var.add(step)
        again, cls = self._again[g.session], _Again.of(g.uses + 1, wide)
        if g.cls is not None:
            again.returned(g.cls, g.ended == g.uses)
        g.uses += 1
        g.last, g.epoch, g.cls, g.p = now, epoch, cls, again.p(cls)
        g.replied = self._replied.get(epoch)
        if g.session:
            self._sessions.move_to_end(g.sid)
            g.served = epoch
            _bounded(self._serving, epoch, g)
        prior = self._gap.value
        g.gap = (g.gap_sum + PRIOR_GAPS * prior) / (g.gaps + PRIOR_GAPS) if g.gaps else prior
        g.var = var = (g.log_m2 + 2 * self._log_var.value) / (max(g.gaps - 1, 0) + 2)
        g.regular = var < REGULAR_LOG_VAR
        sigma = math.sqrt(max(var, 0.0))
        g.slack = min(OVER_FACTOR, math.exp(OVER_Z * sigma - var / 2))
        self._rank(g)
        heapq.heappush(self._open, (g.over, next(self._tie), g, g.uses))
        if not self._scheduled:
            self._close(now)  # no begin to do it
        self._plan(g)

    def _plan(self, g: _Group) -> None:
        """When to stage a regular session into DRAM: its lead before it is expected to start
        (its next arrival, plus the queue's mean wait). Never if that comes after it would be
        over (counted from its reply: a queue longer than the lead and its slack): by then it
        is queued, and the queue's prefetch brings it in (staging it for its arrival instead
        holds DRAM the queue's head needs)."""
        at = g.due + self._wait.value - max(MIN_LEAD_S, LEAD_SHARE * g.gap)
        if g.session and g.regular and self._scheduled and self._ctx.level == 0 and at < g.over:
            g.stage_at = at
            heapq.heappush(self._to_stage, (at, next(self._tie), g, g.uses))
        else:
            g.stage_at = INF

    def _close(self, now: float) -> None:
        """Uses over without a return: their outcome is known now."""
        heap = self._open
        while heap and heap[0][0] <= now:
            _, _, g, uses = heapq.heappop(heap)
            if g.uses != uses or g.ended == uses or g.cls is None:
                continue
            if g.over > now:  # moved later since (counted from its reply): not over yet
                heapq.heappush(heap, (g.over, next(self._tie), g, uses))
                continue
            self._again[g.session].ended(g.cls)
            g.ended = uses

    def _rank(self, g: _Group) -> None:
        g.due = g.anchor + g.gap
        g.over = g.anchor + max(g.slack * g.gap, g.gap + MIN_LEAD_S)
        self._requeue(g)

    def _requeue(self, g: _Group) -> None:
        g.version += 1
        if not g.resident:
            return
        tie = next(self._tie)
        if g.regular:
            heapq.heappush(self._regular, (-g.expected(0.0), -g.depth, tie, g, g.version))
        else:
            heapq.heappush(self._irregular, (g.anchor - g.gap / g.p, -g.depth, tie, g, g.version))
        heapq.heappush(self._by_over, (g.over, -g.depth, tie, g, g.version))
        if len(self._regular) + len(self._irregular) + len(self._by_over) > 8 * self._live + 4096:
            for name in ("_regular", "_irregular", "_by_over"):
                live = [e for e in getattr(self, name) if self._live_entry(e)]
                heapq.heapify(live)
                setattr(self, name, live)

    @staticmethod
    def _live_entry(entry: tuple) -> bool:
        g = entry[3]
        return g.version == entry[4] and g.resident > 0

    def _settle(self) -> None:
        """The requests begun before: a claim their history confirmed by no extension, and a
        request that touched only what was known, were uses of what they touched (a prompt
        seen before)."""
        for epoch, (g, now, keys) in self._claims.items():
            self._unclaim(g)
            self._used(keys, epoch, now)
        for epoch, (now, keys) in self._unclaimed.items():
            if epoch not in self._extended and epoch not in self._claims:
                self._used(keys, epoch, now)
        self._claims.clear()
        self._unclaimed.clear()
        self._extended.clear()

    def _used(self, keys: Sequence[ChunkKey], epoch: int, now: float) -> None:
        """A use of the groups of ``keys``' chunks, each touched in it."""
        for key in keys:
            meta = self._meta.get(key)
            if meta is not None and not meta.group.forgotten:
                self._use(meta.group, epoch, now)
                meta.stamp, meta.dead = meta.group.uses, False
                self._requeue_chunk(key)

    def _claim(self, g: _Group, epoch: int, now: float, keys: Sequence[ChunkKey]) -> None:
        """Request ``epoch`` looked up a prefix of ``g``'s history: until the request shows
        whose it is (its save extends a session) ``g`` ranks as used now, not staged, so that
        making room for that save does not evict the session being served for one due later."""
        g.held = g.last
        g.last = now
        self._rank(g)
        self._claims[epoch] = (g, now, keys)

    def _unclaim(self, g: _Group) -> None:
        if g.held is not None:
            g.last, g.held = g.held, None
            self._rank(g)

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

    def _requeue_chunk(self, key: ChunkKey) -> None:
        """Queue a resident chunk where its metadata says (no-op when it is there already)."""
        slot = self._resident.get(key)
        if slot is None:
            return
        meta = self._meta.get(key)
        if meta is None or meta.group.forgotten or meta.dead:
            if slot.group is not None or key not in self._orphans:
                self._place(key, None)
        elif slot.group is not meta.group or slot.stamp != meta.stamp:
            self._place(key, meta.group, meta.position, meta.stamp)

    def _place(self, key: ChunkKey, g: _Group | None, position: int = 0, stamp: int = 0) -> None:
        """(Re)queue resident ``key`` in group ``g`` (None: with the orphans)."""
        self._unplace(key, self._resident[key])
        tie = next(self._tie)
        self._resident[key] = _Slot(g, tie, stamp)
        if g is None:
            self._orphans[key] = None
            return
        heapq.heappush(g.heap, (stamp, -position, tie, key))
        g.resident += 1
        if g.resident == 1:
            self._live += 1
            self._requeue(g)
        elif len(g.heap) > 2 * g.resident + 16:  # touched again and again: drop stale entries
            resident = self._resident
            g.heap = [e for e in g.heap if (s := resident.get(e[3])) is not None
                      and s.group is g and s.tie == e[2]]
            heapq.heapify(g.heap)

    def _unplace(self, key: ChunkKey, slot: _Slot) -> None:
        g = slot.group
        if g is not None:
            g.resident -= 1
            if not g.resident:
                self._live -= 1
                g.heap.clear()
        self._orphans.pop(key, None)
        self._fresh.pop(key, None)

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

    def _top(self, g: _Group) -> ChunkKey | None:
        heap, resident = g.heap, self._resident
        while heap:
            *_, tie, key = heap[0]
            slot = resident.get(key)
            if slot is not None and slot.group is g and slot.tie == tie:
                return key
            heapq.heappop(heap)
        return None

    def _peek(self, heap: list) -> tuple | None:
        while heap and not self._live_entry(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        self._pressed = True
        window = self._window
        needed: list[tuple[int, ChunkKey]] = []

        def fit(key: ChunkKey | None) -> bool:
            if key is None or not evictable(key):
                return False
            need = window.next_need(key)
            if need is None:
                return True
            needed.append((need, key))
            return False

        for key in self._orphans:
            if fit(key):
                return key
        now = self._now if self._scheduled else time.monotonic()
        if not self._scheduled:
            self._close(now)
        found, aside = None, []
        while found is None:
            over = self._peek(self._by_over)
            if over is not None and over[0] < now:
                heap = self._by_over
            else:
                regular, irregular = self._peek(self._regular), self._peek(self._irregular)
                if regular is None and irregular is None:
                    break
                heap = self._regular if irregular is None or (
                    regular is not None and regular[3].expected(now) >= irregular[3].expected(now)
                ) else self._irregular
            entry = heapq.heappop(heap)
            aside.append((heap, entry))
            key = self._top(entry[3])
            if fit(key):
                found = key
        for heap, entry in aside:
            heapq.heappush(heap, entry)
        if found is not None:
            return found
        for key in reversed(self._fresh):
            if fit(key):
                return key
        return max(needed)[1] if needed else None

    def __len__(self) -> int:
        return len(self._resident)
