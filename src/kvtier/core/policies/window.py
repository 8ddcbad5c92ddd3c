"""The look-ahead window: which chunks the queued requests need, and how soon."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvtier.core.keys import ChunkKey


class QueueWindow:
    """key -> request numbers of the queued requests that need it, soonest first.

    Fed by a policy's ``hint`` (a request joins) and ``begin`` (a request leaves: it is being
    served). Requests are served in the order of their numbers, so each key's numbers stay sorted
    by appending on join and popping from the left on leave.
    """

    def __init__(self) -> None:
        self._need: dict[ChunkKey, deque[int]] = {}
        self._queued: dict[int, list[ChunkKey]] = {}

    def join(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        if seq in self._queued:
            return
        unique = list(dict.fromkeys(keys))
        self._queued[seq] = unique
        need = self._need
        for key in unique:
            seqs = need.get(key)
            if seqs is None:
                need[key] = deque((seq,))
            else:
                seqs.append(seq)

    def leave_through(self, seq: int) -> None:
        """Requests numbered up to ``seq`` are served (or abandoned): forget them."""
        if not self._queued:
            return
        need = self._need
        for done in [s for s in self._queued if s <= seq]:
            for key in self._queued.pop(done):
                seqs = need.get(key)
                if seqs is None:
                    continue
                try:
                    seqs.remove(done)
                except ValueError:
                    pass
                if not seqs:
                    del need[key]

    def next_need(self, key: ChunkKey) -> int | None:
        """Number of the soonest queued request needing ``key``; None if none does."""
        seqs = self._need.get(key)
        return seqs[0] if seqs else None

    def __contains__(self, key: object) -> bool:
        return key in self._need

    def __len__(self) -> int:
        return len(self._queued)
