"""Session hints over a tier's own policy: the order the hints ask for, the policy's within it.

:class:`HintedPolicy` wraps the policy a tier was configured with (``lru``, ``returns``, ...)
and a :class:`~kvtier.core.sessions.SessionBook` that every tier's wrapper shares. Its victims:

1. doomed chunks (every session that held them is done or expired; no remembered session holds
   them), deepest of a session first;
2. the chunks no retained session holds, in the wrapped policy's own order;
3. retained sessions' chunks, the session expected back farthest first, its deepest chunk first
   (within a staging's :meth:`~kvtier.core.sessions.SessionBook.ceiling`: only those ranked
   before the session being staged), from an order built once per change of the book
   (:mod:`kvtier.core.session_order`): a victim costs nothing that grows with how many sessions
   share a chunk.

Everything else (admission, the scheduler hooks, the policy's own staging) is the wrapped
policy's (the store runs that staging under a ceiling that spares every retained chunk). Until
a session is hinted the wrapper only forwards: a store that gets no hints pays one attribute
read per call, and ``kvtier replay`` does not wrap its policies at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.base import EvictionPolicy
from kvtier.core.sessions import SessionBook


class HintedPolicy(EvictionPolicy):
    """``inner``'s order, under what the hinted sessions of ``book`` ask (see the module)."""

    def __init__(self, inner: EvictionPolicy, book: SessionBook, level: int) -> None:
        self.inner = inner
        self.book = book
        self.level = level

    @property  # type: ignore[override]
    def lookahead(self) -> int:
        return self.inner.lookahead

    def insert(self, key: ChunkKey, position: int | None = None) -> None:
        self.inner.insert(key, position)
        if self.book.tracking:
            self.book.inserted(key, self.level)

    def touch(self, keys: Sequence[ChunkKey], cost_s: float | None = None, *, start: int = 0,
              use: int | None = None) -> None:
        self.inner.touch(keys, cost_s, start=start, use=use)
        if self.level == 0 and self.book.tracking:  # the book hears each touch once
            self.book.touched(keys, start, use)

    def remove(self, key: ChunkKey) -> None:
        self.inner.remove(key)
        if self.book.tracking:
            self.book.removed(key, self.level)

    def victim(self, evictable: Callable[[ChunkKey], bool]) -> ChunkKey | None:
        book = self.book
        if not book.tracking:
            return self.inner.victim(evictable)
        book.advance(book.clock())
        level = self.level
        for key in book.doomed.at(level):
            if evictable(key):
                return key
        if book.retained_at[level] < len(self.inner):  # (else every chunk it holds is retained)
            key = self.inner.victim(lambda k: not book.protected(k) and evictable(k))
            if key is not None:
                return key
        return book.retained_victim(level, evictable)

    def __len__(self) -> int:
        return len(self.inner)

    def admit(self, key: ChunkKey, position: int | None) -> bool:
        return self.inner.admit(key, position)

    def begin(self, seq: int, now: float) -> None:
        self.inner.begin(seq, now)

    def hint(self, seq: int, keys: Sequence[ChunkKey]) -> None:
        self.inner.hint(seq, keys)

    def arrived(self, seq: int, keys: Sequence[ChunkKey], now: float) -> None:
        self.inner.arrived(seq, keys, now)

    def finished(self, seq: int, now: float) -> None:
        self.inner.finished(seq, now)

    def staging(self, now: float) -> list[Sequence[ChunkKey]]:
        return self.inner.staging(now)


def hinted_policies(policies: Sequence[EvictionPolicy], book: SessionBook) -> list[EvictionPolicy]:
    """Each tier's policy (fastest first) wrapped over the one ``book``."""
    return [HintedPolicy(policy, book, level) for level, policy in enumerate(policies)]
