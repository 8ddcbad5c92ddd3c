"""Writes: a DRAM slot reserved for a new entry (room made, or waited for), its commit, and its
write-through copy to SSD. A part of :class:`~kvtier.store.cache.ChunkCache`, under its one lock
(see :mod:`kvtier.store.cache`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.store.config import Slot
from kvtier.tiers.base import Reservation, TierFullError
from kvtier.tiers.codec_types import KVFormat

WRITE_THROUGH_TRIES = 3
"""Copies of one entry to SSD a write-through tries (another write may take the room made)."""
WRITE_THROUGH_RETRY_S = 0.1
"""How long a write-through waits for a change (a move ending) before it tries again."""
WRITE_THROUGH_WAIT_S = 30.0
"""How long a write-through waits for an eviction of its entry already copying it to SSD."""


class CacheWrites:
    """:class:`~kvtier.store.cache.ChunkCache`'s writes."""

    def reserve(self, key: ChunkKey, entry: Shape, *, position: int | None = None,
                slot_bytes: int | None = None, remaining: int = 1,
                deadline: float | None = None, fmt: KVFormat | None = None,
                tenant: str = "") -> Reservation | Slot:
        """A DRAM slot for new entry ``key`` (evicting as needed; waits up to ``room_wait_s`` for
        evictions other threads run), or why there is none to write: :attr:`Slot.HELD`,
        :attr:`Slot.BUSY`. Fill ``res.buffer``, then :meth:`commit`. Raises TierFullError if
        every resident entry is pinned or the policy does not admit chunk ``position`` of its
        sequence (``remaining``: chunks of the sequence from this one on, for the counts).
        ``slot_bytes``: the slot size to take when the entry is smaller (a part of a typed
        object takes a chunk's slot). ``fmt``: what the bytes are when they are KV (a lower
        tier with a codec stores them compressed; None: stored raw everywhere). ``tenant``:
        whose chunk it is, recorded with it in every tier it goes to."""
        shape = Shape(slot_bytes, entry.segment_bytes) if slot_bytes else entry
        wait_until = time.monotonic() + self.config.room_wait_s
        deadline = wait_until if deadline is None else min(deadline, wait_until)
        with self._section, self._shaped(shape):
            state = self._slot_state(key)
            if state is not None:
                return state
            if not self.placement.admits(key, position, remaining):
                raise TierFullError(
                    f"no DRAM slot for the chunk: the {self.config.policy} policy did not admit it")
            while not self.placement.make_room(0, entry=shape):
                left = deadline - time.monotonic()
                if not (self.placement.evicting(0) or self.mover.in_flight) or left <= 0:
                    self.placement.stats.dropped += remaining
                    raise TierFullError("no DRAM slot for the chunk: every resident chunk is pinned")
                # another thread's eviction, or a move holding pins (a write-through copy),
                # will end soon: wait for it rather than refuse the chunk
                self._changed.wait(left)  # type: ignore[union-attr]
                self._record_lookups()  # those made while it waited
                state = self._slot_state(key)
                if state is not None:
                    return state
            state = self._slot_state(key)  # making room let others run
            if state is not None:
                return state
            return self.host.reserve(key, entry.nbytes, entry.segment_bytes, slot_bytes=slot_bytes, fmt=fmt,
                                     tenant=tenant)

    def _slot_state(self, key: ChunkKey) -> Slot | None:
        if key in self.index:
            return Slot.HELD
        if self.host.reserving(key):
            return Slot.BUSY
        return None

    def commit(self, res: Reservation, ok: bool = True, *, position: int | None = None) -> Future | bool:
        """Publish (or abandon) a reserved entry. Returns False if nothing was stored, else True
        or, with ``write_through`` (and an SSD tier), the Future of its copy to SSD, which the
        caller may wait for: its result is True once SSD holds the entry, False if it never got
        there (see :meth:`_write_through`; :func:`wait_all` counts those). Uploads to a
        write-through remote tier are not waited for here (the uploader reports them)."""
        with self._section:
            try:
                stored = self.host.commit(res, ok=ok)
            finally:
                self._changed.notify_all()  # type: ignore[union-attr]
            if not stored:
                return False
            self.placement.added(res.key, 0, position)
            self.stats.saved_chunks += 1
            remote = self.config.remote
            if remote is not None and remote.write == "through":
                self._remote_level.upload_from_dram(res.key, self.host, self.mover)  # type: ignore[union-attr]
            if self.config.write_through and self.disk is not None and not self._closed:
                return self._submit(lambda: self._write_through(res.key))
            return True

    def _write_through(self, key: ChunkKey) -> bool:
        """Copy committed entry ``key`` from DRAM to SSD; whether SSD holds it now (it may leave
        SSD later, evicted like any SSD chunk). An eviction of it from DRAM already running is
        waited for (its demotion is the copy). False when it never got there: DRAM dropped it
        first (evicted while SSD could not take it), SSD's policy refused it, or every try failed
        (room taken by another write meanwhile, every SSD chunk pinned, an I/O error); such a
        try is made again, ``WRITE_THROUGH_TRIES`` in all, after the next change or a short
        wait."""
        with self._section:
            placement, index = self.placement, self.index
            for attempt in range(WRITE_THROUGH_TRIES):
                deadline = time.monotonic() + WRITE_THROUGH_WAIT_S
                while placement.leaving(key, 0) and time.monotonic() < deadline:
                    self._changed.wait(WRITE_THROUGH_RETRY_S)  # type: ignore[union-attr]
                    self._record_lookups()
                if index.holds(key, 1) or not index.holds(key, 0) or placement.leaving(key, 0):
                    break
                refused = placement.stats.refused
                if placement.demote(key, 0) or placement.stats.refused != refused:
                    break  # on SSD, or its policy did not admit it (asking again would not help)
                if attempt + 1 < WRITE_THROUGH_TRIES:
                    self._changed.wait(WRITE_THROUGH_RETRY_S)  # type: ignore[union-attr]
                    self._record_lookups()
            return index.holds(key, 1)


def wait_all(results: Sequence[Future | bool]) -> int:
    """Wait for the futures among :meth:`ChunkCache.commit`'s results (write-through copies);
    how many of them did not reach SSD (result False, or the copy failed)."""
    missed = 0
    for r in results:
        if isinstance(r, Future):
            missed += r.result() is not True
    return missed
