"""The ``returns`` policy's eviction order (see :mod:`kvtier.core.policies.returns`): lazy heaps
of groups and of each group's resident chunks, the victim they give, and the sessions a staging
brings back into DRAM as far as it holds chunks expected farther."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.returns_model import INF, _Group

BUDGET_SCAN = 16
"""Groups looked at, farthest first, to size what one staging may evict."""


@dataclass(slots=True)
class _Slot:
    """Where a resident chunk is queued: a group's heap (entry ``tie``), or none (orphan,
    fresh)."""

    group: _Group | None
    tie: int
    stamp: int = 0


class ReturnsHeaps:
    """:class:`~kvtier.core.policies.returns.ReturnsPolicy`'s heaps, the victim and the staging
    (the policy holds the state)."""

    def staging(self, now: float) -> list[Sequence[ChunkKey]]:
        """Regular sessions within their lead of their expected return and not in DRAM for
        it, as their latest sequences (prefix order), soonest expected first; each only as far
        as DRAM holds chunks expected farther than it (see :mod:`kvtier.core.policies.returns`).
        A session whose staged chunks are evicted before it comes back waits to be staged again.
        None while a request is queued (announced with ``hint`` and not begun)."""
        heap, waiting = self._to_stage, self._waiting
        while heap and heap[0][0] <= now:
            at, _, g, uses = heapq.heappop(heap)
            if g.uses == uses and g.stage_at == at:
                waiting[g] = None
        for g in [g for g in waiting if g.forgotten or g.staged == g.uses or now >= g.over
                  or not g.regular]:
            del waiting[g]
        if not waiting or self._queued:
            return []  # behind a queue a session is prefetched as the queue's own (see :mod:`kvtier.core.policies.returns`)
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
