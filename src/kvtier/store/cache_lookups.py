"""Lookups: the longest held prefix of a sequence and each entry's state, read without waiting
for the cache's lock (the remote tier probed outside it), their touches and counts recorded by
whoever holds the lock next. A part of :class:`~kvtier.store.cache.ChunkCache`, under its one
lock (see :mod:`kvtier.store.cache`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.core.index import PrefixHit
from kvtier.core.keys import ChunkKey
from kvtier.store.config import EntryState

log = logging.getLogger(__name__)

MAX_DEFERRED_LOOKUPS = 4096
"""Lookups whose touches wait for the lock at most; past that a lookup records them itself."""


class CacheLookups:
    """:class:`~kvtier.store.cache.ChunkCache`'s lookups."""

    def lookup_keys(self, keys: Sequence[ChunkKey], *, use: int | None = None,
                    tokens: tuple[int, int] | None = None, tenant: str | None = None) -> PrefixHit:
        """The longest run of held chunks from the first (remote tier asked for those past the
        locally held prefix, outside the lock); touches them.

        Waits for nobody: the index is read without the lock (its reads are single dict reads;
        a lookup is advice -- every read that follows checks again what it finds), and the
        touch and the counts are recorded by whoever holds the lock next (at once if nobody
        does), so a lookup never queues behind another client's bookkeeping. ``tokens``: the
        lookup's (tokens looked up, tokens per chunk), for the token counts. ``tenant``: whose
        keys these are (a remote tier that keeps tenants apart is asked under it)."""
        keys = list(keys)
        if self._remote_level is not None:
            with self.mover.shaped(None, tenant):
                self._remote_level.probe(keys, tenant or "")
        hit = self.index.longest_prefix(keys)
        self._lookups.append((hit, len(keys), use, tokens))
        if len(self._lookups) > MAX_DEFERRED_LOOKUPS:
            with self._section:  # records them on entry
                pass
        elif self._lock.acquire(blocking=False):
            try:
                self._record_lookups()
            finally:
                self._lock.release()
        return hit

    def held(self, keys: Sequence[ChunkKey], *, tenant: str | None = None,
             remote: bool = False) -> list[int | None]:
        """The fastest level holding each of ``keys``, each on its own (not a prefix; None: not
        held). Lock-free as :meth:`lookup_keys` is, and advice as it is; touches and counts
        nothing: it probes candidates (the partial chunks an engine may have saved) and the
        engine's load of the one it picks is what counts. ``remote``: the remote tier is asked
        (one round trip, outside the lock) for those held nowhere here -- a partial chunk
        another machine saved -- else only what the index knows is answered."""
        if remote and self._remote_level is not None:
            with self.mover.shaped(None, tenant):
                self._remote_level.probe_each(list(keys), tenant or "")
        return [self.index.fastest(key) for key in keys]

    def _record_lookups(self) -> None:
        """Touch and count the lookups made since (under the lock)."""
        st, tiers, lookups = self.stats, self.tiers, self._lookups
        while lookups:
            hit, n, use, tokens = lookups.popleft()
            try:
                self.placement.touch(hit.keys, use=use)
            except Exception:  # another caller's bookkeeping must not fail this one
                log.exception("recording a lookup failed")
            st.lookups += 1
            if tokens is not None:
                st.lookup_tokens += tokens[0]
                st.hit_tokens += len(hit) * tokens[1]
            absent = n - len(hit)
            for level, tier in enumerate(tiers):
                st.hits[tier.name] += hit.levels.count(level)
                st.misses[tier.name] += absent + sum(1 for lvl in hit.levels if lvl > level)

    def contains(self, key: ChunkKey) -> bool:
        with self._section:
            return key in self.index

    def states(self, key: ChunkKey) -> dict[str, EntryState]:
        """The entry's state in each tier that has it (the remote tier as the index knows it)."""
        with self._section:
            out: dict[str, EntryState] = {}
            for level, tier in enumerate(self.tiers):
                if level == 0 and self.host.reserving(key):
                    out[tier.name] = EntryState.WRITING
                elif not self.index.holds(key, level):
                    continue
                elif self.placement.leaving(key, level):
                    out[tier.name] = EntryState.EVICTING
                elif tier.is_pinned(key):
                    out[tier.name] = EntryState.READING
                else:
                    out[tier.name] = EntryState.READABLE
            return out
