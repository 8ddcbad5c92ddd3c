"""Promotions: the live mover's reads from a lower tier (SSD, remote) straight into DRAM
reservations, one chunk or a batch at a time, and the release of reservations that reads given
up on may still write. A part of :class:`~kvtier.store.moves.TierMover` (see
:mod:`kvtier.store.moves` for the lock and the entry states)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Copied, Move, Shape
from kvtier.tiers.base import EntryExistsError, Reservation, Tier, TierFullError
from kvtier.tiers.disk import DiskTier

log = logging.getLogger(__name__)

WAIT_FOR_WRITER_S = 0.5
"""How long a promotion waits for another thread's write of the same chunk (it may be a daemon
client's write lease, held for a whole forward pass: then the promotion gives up)."""


class Promotions:
    """:class:`~kvtier.store.moves.TierMover`'s copies into DRAM from a lower tier (it holds the
    tiers, the lock and the handlers these use)."""

    def _reserve_up(self, key: ChunkKey, source: Tier, level: int) -> Reservation | Copied:
        """A DRAM reservation for ``key`` coming up from ``source`` (under the lock), or the
        outcome when there is none to make: another thread writes the chunk (waited for)."""
        shape = self.entry_of(level, key)
        if shape is None:
            with self.unlocked():
                n = source.entry_bytes(key)
            if n is None:
                return Copied.SOURCE_LOST
            shape = Shape(n, n)
        tenant = source.tenant_of(key) if isinstance(source, DiskTier) else self._tenant_of(key)
        try:
            return self.host.reserve(key, shape.nbytes, shape.segment_bytes, fmt=source.format_of(key),
                                     tenant=tenant or "")
        except EntryExistsError:
            return self._await_writer(key)
        except (TierFullError, ValueError) as exc:  # the room made was taken meanwhile: a miss now
            log.info("copying chunk %s from %s to host failed: %s", key.hex(), source.name, exc)
            return Copied.FAILED

    def _await_writer(self, key: ChunkKey) -> Copied:
        """Another thread is writing ``key`` into DRAM (a save, a promotion): wait for it."""
        host = self.host
        if self.changed is not None:
            self.changed.wait_for(lambda: not host.reserving(key), timeout=WAIT_FOR_WRITER_S)
        return Copied.PRESENT if host.contains(key) else Copied.FAILED

    def _read_up(self, move: Move) -> Copied:
        key, source = move.key, self.tiers[move.src]
        res = self._reserve_up(key, source, move.src)
        if isinstance(res, Copied):
            return res
        late: list[Future] = []
        try:
            with self.unlocked():
                ok = self._handler(move.src, move.dst).run(source.get_into, key, res.buffer, late.append)
        except ValueError as exc:  # held there at another size than asked for: a miss, kept there
            self._release_all(late, self.host, [res])
            self.notify()
            log.info("chunk %s in %s is not of the size asked for: %s", key.hex(), source.name, exc)
            return Copied.FAILED
        except BaseException:
            self._release_all(late, self.host, [res])
            self.notify()
            raise
        if late:  # a read given up on may still write the reservation: it is abandoned after
            self._release_all(late, self.host, [res])
            return Copied.SOURCE_LOST
        stored = self.host.commit(res, ok=ok)
        self.notify()
        if not ok:
            return self._not_read(source, key)
        return Copied.OK if stored else Copied.FAILED

    def _not_read(self, source: Tier, key: ChunkKey) -> Copied:
        """A read that failed: the copy is lost if the source dropped it (damage) or is the
        remote tier (its index entry is only a hint); an SSD chunk still there failed for a
        reason of the machine (EMFILE, EIO) and stays."""
        if isinstance(source, DiskTier) and source.contains(key):
            return Copied.FAILED
        return Copied.SOURCE_LOST

    def copy_many(self, moves: Sequence[Move]) -> list[Copied]:
        """:meth:`copy` of each move; chunks read from a lower tier are read with one
        ``get_many_into`` (one round trip to the remote tier) straight into the destination's
        reservations."""
        if len(moves) < 2 or moves[0].src == 0 or moves[0].dst != 0:
            return [self.copy(move) for move in moves]
        src = moves[0].src
        source = self.tiers[src]
        results = [Copied.FAILED] * len(moves)
        held: list[tuple[int, Reservation]] = []
        for i, move in enumerate(moves):
            res = self._reserve_up(move.key, source, src)
            if isinstance(res, Copied):
                results[i] = res
            else:
                held.append((i, res))
        if not held:
            return results
        late: list[Future] = []
        try:
            with self.unlocked():
                oks = self._handler(src, 0).run(
                    source.get_many_into, [moves[i].key for i, _ in held], [res.buffer for _, res in held],
                    late.append)
        except BaseException as exc:  # ValueError: an entry of another size
            self._release_all(late, self.host, [res for _, res in held])
            self.notify()
            if not isinstance(exc, ValueError):
                raise
            if late:  # the source is down: nothing to retry now
                return results
            retry = {i for i, _ in held}  # one by one, each sized by its source
            return [self.copy(m) if i in retry else results[i] for i, m in enumerate(moves)]
        # reads given up on may still write the unread reservations: released once they end
        self._release_all(late, self.host, [res for (_, res), ok in zip(held, oks, strict=True) if not ok])
        for (i, res), ok in zip(held, oks, strict=True):
            results[i] = ((Copied.OK if self.host.commit(res, ok=True) else Copied.FAILED) if ok
                          else self._not_read(source, moves[i].key))
        for i, r in enumerate(results):  # "present" was found before the batch released the lock
            if r is Copied.PRESENT and not self.host.contains(moves[i].key):
                results[i] = Copied.FAILED
        self.notify()
        return results

    # -- reads given up on --------------------------------------------------------------------
    def _release_all(self, late: list[Future], target: Tier, reservations: list[Reservation]) -> None:
        """Release ``reservations`` now, or, when reads given up on (``late``) may still write
        them, once every one of those calls has ended (on a thread of its own: the calls may
        end right here, under the store's lock)."""
        if not late:
            for res in reservations:
                target.commit(res, ok=False)
            return
        lock, left = threading.Lock(), [len(late)]

        def ended(_: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                threading.Thread(target=self._abandon, args=(target, reservations), daemon=True,
                                 name="kvtier-late-abandon").start()

        for future in late:
            future.add_done_callback(ended)

    def _abandon(self, target: Tier, reservations: list[Reservation]) -> None:
        try:
            if self._lock is None:
                for res in reservations:
                    target.commit(res, ok=False)
                return
            with self._lock:
                for res in reservations:
                    target.commit(res, ok=False)
                self.notify()
        except ValueError:  # the tier was closed meanwhile: nothing left to release
            log.debug("late abandon of %d reservations: %s already closed", len(reservations), target.name)
