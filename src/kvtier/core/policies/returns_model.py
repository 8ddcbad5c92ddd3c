"""What the ``returns`` policy learns (see :mod:`kvtier.core.policies.returns`): per group (a
session, or a chunk shared by sessions) its think times and when it is expected back, the odds
that a group returns at all, the constants that tune them, and the updates each use makes."""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.core.keys import ChunkKey

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


class ReturnsModel:
    """:class:`~kvtier.core.policies.returns.ReturnsPolicy`'s learning: each use of a group
    updates its gaps, its odds and its rank (the policy holds the state)."""

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
