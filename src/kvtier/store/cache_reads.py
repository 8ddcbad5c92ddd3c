"""Reads: pinning a sequence's held prefix in DRAM (promoting it from SSD or the remote tier),
reading one entry from wherever it is, and forgetting copies found lost. A part of
:class:`~kvtier.store.cache.ChunkCache`, under its one lock (see :mod:`kvtier.store.cache`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.store.config import Held
from kvtier.tiers.base import Tier

T = TypeVar("T")


class CacheReads:
    """:class:`~kvtier.store.cache.ChunkCache`'s reads."""

    def acquire(self, keys: Sequence[ChunkKey], *, entry: Shape | None = None, start: int = 0,
                use: int | None = None, touch: bool = True, deadline: float | None = None,
                last_entry: Shape | None = None, tenant: str | None = None) -> list[Held]:
        """Pin the longest held prefix of ``keys`` in DRAM, promoting chunks from SSD or the
        remote tier, and return where each is. The caller reads the slots, then calls
        :meth:`release` with their keys. ``entry``: the shape of these chunks (for a store of
        any model: what a chunk coming up from the remote tier will be). Shorter than the held
        prefix when DRAM cannot hold it all (what is pinned already, by anyone, stays).
        ``touch``: count this as a use of the chunks (``start``: the position of ``keys[0]``
        in its sequence; ``use``: the request). ``deadline`` (``time.monotonic()``): promote no
        more after it; what is pinned by then is returned (a daemon answers within its client's
        timeout; the client asks again for the rest). ``last_entry``: the shape of the last of
        ``keys`` when it differs (a partial chunk, stored at its own size). ``tenant``: whose
        keys these are (chunks come up from that tenant's part of the remote tier; None: the
        tenant each was found under). Raises ValueError, pinning nothing, if a key is listed
        twice: each returned entry holds one pin, which :meth:`release` of its key ends."""
        keys = list(keys)
        seen: set[ChunkKey] = set()
        for k in keys:
            if k in seen:
                raise ValueError(f"acquire: chunk {k.hex()} is listed twice; each key may be acquired "
                                 "once a call (one pin, ended by one release)")
            seen.add(k)
        out: list[Held] = []
        last = (keys[-1], last_entry) if keys and last_entry is not None else None
        with self._section, self._shaped(entry, tenant, last):
            if self.remote_level is not None:  # a run held in the remote tier: one round trip
                lost = self.placement.stats.lost
                self.placement.promote_prefix(keys, level=self.remote_level, deadline=deadline)
                self.stats.load_failures += self.placement.stats.lost - lost
            host, index = self.host, self.index
            prefix = index.longest_prefix(keys)
            early = [k for k, lvl in zip(prefix.keys, prefix.levels, strict=True) if lvl == 0 and host.pin(k)]
            pinned_early = set(early)
            try:
                for key in prefix.keys:
                    level = index.fastest(key)
                    if level is None:
                        break
                    source = self.tiers[level].name
                    if key in pinned_early:
                        pinned_early.discard(key)
                    else:
                        if level > 0 and deadline is not None and time.monotonic() > deadline:
                            break
                        if level > 0:
                            lost = self.placement.stats.lost
                            ok = self.placement.promote(key, level)
                            self.stats.load_failures += self.placement.stats.lost - lost
                            if not ok:
                                break
                        if not host.pin(key):
                            break
                    out.append(Held(key, host.slot_of(key), host.entry_bytes(key), source))  # type: ignore[arg-type]
            finally:
                for key in pinned_early:  # pinned ahead but not returned
                    host.unpin(key)
            if touch:
                self.placement.touch([h.key for h in out], start=start, use=use)
            for h in out:  # handed to a client, which reads the slot itself
                self.stats.loaded_chunks[h.source] += 1
                host.stats.hits += 1
                host.stats.bytes_read += h.nbytes
        return out

    def release(self, keys: Sequence[ChunkKey]) -> None:
        """Undo :meth:`acquire`'s pins."""
        with self._section:
            for key in keys:
                self.host.unpin(key)
            self._changed.notify_all()  # type: ignore[union-attr]  # a writer may be waiting for room

    def read(self, key: ChunkKey, read: Callable[[int, Tier], T | None], *,
             promote: bool = True, entry: Shape | None = None) -> tuple[T, int] | None:
        """``read(level, tier)`` the entry, pinned there, outside the lock, from the tier the
        placement picks (promoting it into DRAM first when ``promote``); with the level it was
        found in before promotion. A failed read is counted, that copy forgotten, and the next
        tier tried; None if none could be read."""
        while True:
            with self._section, self._shaped(entry):
                found = self.index.fastest(key)
                if found is None:
                    return None
                level = self.placement.source(key, promote)
                if level is None:
                    return None
                tier = self.tiers[level]
                held = self.mover.pin(level, key)
            got = None
            raised = True
            try:
                if held:
                    got = read(level, tier)
                raised = False
            finally:
                with self._section:
                    if held:
                        tier.unpin(key)
                    kept = False
                    if got is None and not raised:
                        self.stats.load_failures += 1
                        # a local tier that still has it failed for a reason of the machine
                        # (EMFILE, EIO): a miss now, the chunk stays; damage left the tier
                        kept = held and level != self.remote_level and tier.contains(key)
                        if not kept:
                            self._forget(key, level)
            if got is not None:
                return got, found
            if kept:
                return None

    def forget(self, key: ChunkKey) -> None:
        """Forget ``key`` in every tier (an object that cannot be completed)."""
        with self._section:
            for level in self.index.levels(key):
                self._forget(key, level)

    def _forget(self, key: ChunkKey, level: int) -> None:
        """The tier lost the entry (damage found on read): drop it from the index, and from the
        tier unless someone still reads it (the remote tier removes damaged objects itself)."""
        self.placement.forget(key, level)
        if level == self.remote_level:
            self._remote_level.forgotten(key)  # type: ignore[union-attr]
            return
        tier = self.tiers[level]
        if tier.contains(key) and not tier.is_pinned(key):
            tier.delete(key)
