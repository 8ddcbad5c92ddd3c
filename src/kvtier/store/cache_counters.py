"""Counters: what the cache has counted (every lookup recorded first), what engines report
adding to it, and the snapshot of each tier's capacity, use and counts. A part of
:class:`~kvtier.store.cache.ChunkCache`, under its one lock (see :mod:`kvtier.store.cache`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict

from kvtier.store.results import StoreStats


class CacheCounters:
    """:class:`~kvtier.store.cache.ChunkCache`'s counters."""

    def recorded_stats(self) -> StoreStats:
        """The counters, every lookup made so far counted."""
        with self._section:
            return self.stats

    def count(self, **deltas: int) -> None:
        """Add to the store's counters (``lookup_tokens=...``), under the lock."""
        with self._section:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def count_loaded(self, took: Iterable[tuple[str, int]], had: int = 0, failed: int = 0) -> None:
        """What an engine reports it took: ``(tier found in, tokens)`` per chunk, the tokens it
        already had, and the chunks it could not load."""
        with self._section:
            for tier, tokens in took:
                self.stats.loaded_tokens[tier] += tokens
            self.stats.had_tokens += had
            self.stats.engine_load_failures += failed

    def snapshot(self) -> dict[str, object]:
        """Capacity, use and counters per tier, and the store's own counters (session hints'
        included: ``hints_accepted``, ``hints_refused``, ``sessions_retained``, ``sessions_done``,
        ``hint_stagings``, ``hint_staged_chunks``)."""
        used = [t.used for t in self.tiers]  # (a remote tier's is a round trip: never under the lock)
        with self._section:
            s, ps = self.stats, self.placement.stats
            return {
                "tiers": {
                    t.name: {
                        "capacity_bytes": t.capacity,
                        "used_bytes": used[level],
                        "chunks": self.index.count(level),
                        "hits": s.hits[t.name],
                        "misses": s.misses[t.name],
                        "evictions": ps.evictions[level],
                        "pinned": t.pinned_count(),  # distinct entries
                        "pins": t.pin_total(),  # every pin held: more than pinned when nested
                        "reserved": t.reserved_count(),
                        "io": t.stats.as_dict(),
                    }
                    for level, t in enumerate(self.tiers)
                },
                "lookups": s.lookups,
                "lookup_tokens": s.lookup_tokens,
                "hit_tokens": s.hit_tokens,
                "loaded_tokens": dict(s.loaded_tokens),
                "loaded_chunks": dict(s.loaded_chunks),
                "had_tokens": s.had_tokens,
                "saved_chunks": s.saved_chunks,
                "dedup_chunks": s.dedup_chunks,
                "busy_chunks": s.busy_chunks,
                "dropped_chunks": s.dropped_chunks,
                "demotions": sum(ps.writes_down[1:]),
                "promotions": ps.promotions,
                "prefetched": ps.prefetched,
                "prefetches_dropped": s.prefetches_dropped,
                "prefetch_hits": ps.prefetch_hits,
                "load_failures": s.load_failures,
                "engine_load_failures": s.engine_load_failures,
                "uploads": asdict(self.uploader.stats) if self.uploader is not None else {},
                **self.hint_counters(),
            }
