"""``cost``: keep the chunks that save the most prefill time per byte.

A chunk's value in a tier is ``P(reused) x s ** SAVING_EXPONENT`` where ``s`` is the time to
recompute it minus the time to load it from this tier. Recompute time comes from the :class:`~kvtier.core.cost_model.ComputeModel` and grows
with the chunk's position (its tokens attend to the whole history before them). ``P(reused)`` is
learned online from the traffic itself: for chunks used ``u`` times so far (1, 2, 3, 4+) and
whose sequence's first chunk (its prefix family: a system prompt, a shared document) has or has
not been reused, the share that were used again.

Recency enters GreedyDual-style (Cao and Irani, 1997): a touched chunk gets priority
``L + value``, the victim is the lowest priority, and ``L`` rises to each victim's priority, so
a chunk not used for a while falls behind newer ones in proportion to its value. Prefix-aware:
along a sequence, a chunk's value is at least that of any later chunk (losing it loses them),
and among equal priorities the deepest chunk goes first.

Like ``attentionstore`` it hears of the whole queue and protects the chunks the queued requests
need (and the scheduler prefetches them): such a chunk leaves the heap the first time an
eviction meets it and returns when no queued request needs it, so an eviction does not step
over the same needed chunks again; when every candidate is needed, the one needed farthest
goes. Admission: once the SSD tier has had to evict, a demoted chunk
whose learned reuse probability is below ``MIN_ADMIT_P`` is not written to it (saving SSD
writes); DRAM admits everything, since a chunk it refuses would be stored nowhere.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.attentionstore import QUEUE_LOOKAHEAD
from kvtier.core.policies.base import EvictionPolicy, TierContext
from kvtier.core.policies.window import QueueWindow, top_evictable

MAX_USES = 4
MAX_TAIL = 4
MIN_ADMIT_P = 0.01
MIN_SAMPLES = 256
FRESH = float("inf")
SAVING_EXPONENT = 0.5
"""The recompute saving enters the value damped. Measured on the Mooncake trace and generated
sessions (`kvtier replay --sweep`): with the saving taken whole, the deep chunks of a few long
conversations (whose saving is up to ~20x a first chunk's) outlive everything else in a small
DRAM, and at 2% of the footprint ``cost`` saved 9% less than ``attentionstore``; damped, it saves
more than ``attentionstore`` at every capacity, and the same elsewhere within 1%. The learned
reuse probability is per class, not per chunk, so it over-trusts one long conversation."""
MAX_GHOSTS = 1 << 20
"""Keys remembered (use counts, position) beyond those resident; the oldest are forgotten."""


KV_CLASSES = (MAX_USES + 1) * (MAX_TAIL + 1)


def _class_of(uses: int, tail: int, declared: bool = False) -> int:
    """KV chunks and parts of typed objects (declared costs) are learned apart: an index's
    last part is not a prompt's partial last chunk."""
    return min(uses, MAX_USES) * (MAX_TAIL + 1) + min(tail, MAX_TAIL) + KV_CLASSES * declared


@dataclass(slots=True)
class _Meta:
    uses: int
    position: int
    cls: int
    last_epoch: int
    declared: float | None = None
    """Saving of a hit declared by the caller (a typed object's part), else from position."""


class _ReuseModel:
    """P(a chunk is used again | its class), counted online.

    The class is the chunk's use count so far (1, 2, 3, 4+) and how far it is from the end of
    the sequence that last used it (0 for the last chunk, up to 4+): a conversation's next turn
    reuses its whole prompt, but a prompt's last chunks are often only partly filled or
    specific to that one question, and are reused far less.
    """

    def __init__(self) -> None:
        size = 2 * KV_CLASSES
        self._seen = [0] * size
        self._reused = [0] * size

    def seen(self, cls: int, delta: int = 1) -> None:
        self._seen[cls] += delta

    def reused(self, cls: int) -> None:
        self._reused[cls] += 1

    def samples(self, cls: int) -> int:
        return self._seen[cls]

    def p(self, cls: int) -> float:
        return (self._reused[cls] + 1) / (self._seen[cls] + 2)


class CostPolicy(EvictionPolicy):
    lookahead = QUEUE_LOOKAHEAD
    FAR_SLACK = 1024
    """Stale entries ``_far`` may hold beyond four per held chunk before it is rebuilt."""

    def __init__(self, context: TierContext | None = None) -> None:
        self._ctx = context or TierContext()
        self._saving: list[float] = []
        self._meta: OrderedDict[ChunkKey, _Meta] = OrderedDict()
        self._model = _ReuseModel()
        self._resident: dict[ChunkKey, float] = {}  # key -> priority it was queued with
        self._heap: list[tuple[float, int, int, ChunkKey]] = []  # (priority, -position, tie, key)
        self._tie = itertools.count()
        self._inflation = 0.0
        self._epoch = 0
        self._epochs_from_begin = False
        self._window = QueueWindow()
        # Chunks queued requests need leave the heap for ``_held`` (their entry) the first time
        # an eviction meets them, and go back when no queued request needs them any more; the
        # farthest needed is the top of ``_far`` (-need, then the heap's own order).
        self._held: dict[ChunkKey, tuple[float, int, int, ChunkKey]] = {}
        self._far: list[tuple[int, float, int, int, ChunkKey]] = []
        self._pressed = False  # the tier has had to evict

    # -- scheduler hooks ----------------------------------------------------------------------
    def begin(self, seq: int, now: float) -> None:
        self._epochs_from_begin = True
        self._epoch = seq + 1
        window, held = self._window, self._held
        for key in window.leave_through(seq):
            entry = held.get(key)
            if entry is None:
                continue
            need = window.next_need(key)
            if need is None:
                del held[key]
                if self._resident.get(key) == entry[0]:
                    heapq.heappush(self._heap, entry)
            else:
                heapq.heappush(self._far, (-need, *entry))
        self._trim_far()

    def _far_live(self, top: tuple[int, float, int, int, ChunkKey]) -> bool:
        key = top[4]
        return self._held.get(key) == top[1:] and self._resident.get(key) == top[1] \
            and self._window.next_need(key) == -top[0]

    def _trim_far(self) -> None:
        """Drop ``_far``'s stale entries once they outnumber the live ones (a shared prefix that
        every queued request needs gets a new entry at each ``begin``)."""
        if len(self._far) > 4 * len(self._held) + self.FAR_SLACK:
            self._far = [t for t in self._far if self._far_live(t)]
            heapq.heapify(self._far)

    def hint(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        self._window.join(seq, keys)

    # -- value --------------------------------------------------------------------------------
    def _saving_at(self, position: int) -> float:
        saving = self._saving
        while len(saving) <= position:
            saving.append(self._ctx.miss_saving_s(len(saving)))
        return saving[position]

    def _value(self, meta: _Meta) -> float:
        if meta.declared is not None:
            return self._model.p(meta.cls) * meta.declared
        # In seconds like a declared cost; only the growth with position is damped.
        first = self._saving_at(0)
        saving = self._saving_at(meta.position)
        if first <= 0.0:
            return self._model.p(meta.cls) * saving ** SAVING_EXPONENT
        return self._model.p(meta.cls) * first * (saving / first) ** SAVING_EXPONENT

    def _queue(self, key: ChunkKey, priority: float, position: int) -> None:
        self._resident[key] = priority
        heapq.heappush(self._heap, (priority, -position, next(self._tie), key))
        if len(self._heap) > 4 * len(self._resident) + 1024:
            # one live entry per key: a key queued again at the same priority (no eviction
            # raised the inflation meanwhile) leaves a duplicate that would defeat the compaction
            live: dict[ChunkKey, tuple[float, int, int, ChunkKey]] = {}
            for e in self._heap:
                if self._resident.get(e[3]) == e[0]:
                    live.setdefault(e[3], e)
            self._heap = list(live.values())
            heapq.heapify(self._heap)

    # -- EvictionPolicy -----------------------------------------------------------------------
    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        if not keys:
            return
        declared = None if cost_s is None else self._ctx.hit_saving_s(cost_s)
        if use is not None:
            epoch = use + 1  # the numbering of begin(): a request's touches are one use
        elif self._epochs_from_begin:
            epoch = self._epoch
        else:
            self._epoch += 1  # no scheduler: every touch counts as a use
            epoch = self._epoch
        metas, model = self._meta, self._model
        last = len(keys) - 1
        for i, key in enumerate(keys):
            pos = start + i
            cls = _class_of(1, last - i, declared is not None)
            meta = metas.get(key)
            if meta is None:
                metas[key] = _Meta(1, pos, cls, epoch, declared)
                model.seen(cls)
                continue
            if meta.last_epoch != epoch:  # a new use
                model.reused(meta.cls)
                meta.uses += 1
                meta.last_epoch = epoch
                metas.move_to_end(key)
            else:  # touched again in the same use (lookup, then save): re-classify
                model.seen(meta.cls, -1)
            meta.position = pos
            if declared is not None:
                meta.declared = declared
            meta.cls = _class_of(meta.uses, last - i, meta.declared is not None)
            model.seen(meta.cls)
        value = 0.0
        resident = self._resident
        for i in range(last, -1, -1):
            key = keys[i]
            value = max(value, self._value(metas[key]))
            if key in resident:
                self._queue(key, self._inflation + value, start + i)
        # The oldest ghosts go only now: every key of this call must still be known above.
        while len(metas) > MAX_GHOSTS + len(resident):
            metas.popitem(last=False)

    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        meta = self._meta.get(key)
        if meta is None:
            # A chunk being saved: the save's touch, which the store always makes right after
            # its inserts, sets its real priority. Until then it is not a victim while any
            # touched chunk is; among such chunks the deepest goes first (losing it loses
            # nothing before it).
            self._queue(key, FRESH, position or 0)
        else:
            self._queue(key, self._inflation + self._value(meta), meta.position)

    def admit(self, key: ChunkKey, position: int | None) -> bool:
        if self._ctx.level == 0 or not self._pressed:
            return True  # refused by DRAM a saved chunk is stored nowhere; with room, keep all
        meta = self._meta.get(key)
        if meta is None or self._model.samples(meta.cls) < MIN_SAMPLES:
            return True
        return self._model.p(meta.cls) >= MIN_ADMIT_P

    def remove(self, key: ChunkKey) -> None:
        self._resident.pop(key, None)
        if self._held.pop(key, None) is not None:
            self._trim_far()

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        heap, resident, window, held = self._heap, self._resident, self._window, self._held
        self._pressed = True
        aside: list[tuple[float, int, int, ChunkKey]] = []
        found: ChunkKey | None = None
        try:
            while heap:
                entry = heapq.heappop(heap)
                key = entry[3]
                if resident.get(key) != entry[0]:
                    continue  # stale: removed, or queued again since
                need = window.next_need(key)
                if need is not None:  # needed soon: out of the heap until it is not
                    kept = held.get(key)  # a key queued twice at one priority has two live
                    if kept is None or resident.get(key) != kept[0] or entry < kept:  # entries: the first counts
                        held[key] = entry
                        heapq.heappush(self._far, (-need, *entry))
                    continue
                aside.append(entry)
                if not evictable(key):
                    continue
                found = key
                if entry[0] != FRESH:  # a chunk never touched must not inflate every priority
                    self._inflation = max(self._inflation, entry[0])
                break
        finally:
            for entry in aside:
                heapq.heappush(heap, entry)
        if found is None:  # every candidate is needed soon: the farthest goes
            found = self._farthest(evictable)
        return found

    def _farthest(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        found = top_evictable(self._far, evictable, self._far_live)
        self._trim_far()
        return found

    def __len__(self) -> int:
        return len(self._resident)
