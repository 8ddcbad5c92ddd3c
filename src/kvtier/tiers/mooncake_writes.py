"""The write path of the Mooncake tier: reserve and commit (a put session), and put_many's
batch of objects, one session start and end for all, sent while the caller checksums the
next."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from mooncake.store import MooncakeDistributedStore

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import (
    EntryExistsError,
    PutOutcome,
    Reservation,
    TierFullError,
    TierUnavailableError,
)
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.coded import Coding
from kvtier.tiers.mooncake_calls import (
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    REPLICA_IS_NOT_READY,
    ZERO_COPY_MIN,
    Relay,
    start_sessions,
    upload,
)
from kvtier.tiers.mooncake_index import MooncakeIndex
from kvtier.tiers.mooncake_io import Unavailable, code_name, is_outage
from kvtier.tiers.remote_format import ObjectHeader

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Open:
    staging: torch.Tensor
    header_len: int
    charge: int


class MooncakeWrites(MooncakeIndex):
    """How :class:`~kvtier.tiers.mooncake.MooncakeTier` writes chunks."""

    def _refusal(self, key: ChunkKey, rc: int, what: str) -> TierFullError | EntryExistsError:
        """What ``reserve`` raises for a refused Mooncake put (local charge returned)."""
        self._settle(key, None)
        if rc in (OBJECT_ALREADY_EXISTS, REPLICA_IS_NOT_READY):
            return EntryExistsError(f"mooncake: chunk {key.hex()} is already stored or being written")
        if rc != NO_AVAILABLE_HANDLE:
            self.stats.errors += 1
            log.warning("mooncake: %s of chunk %s failed: %s", what, key.hex(), code_name(rc))
        return TierFullError(f"mooncake: {what} refused: {code_name(rc)}")

    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None) -> Reservation:
        key, seg, charge = self._check_request(key, nbytes, segment_bytes)
        self._charge(key, charge)
        name = self._name(key)
        staging = None
        try:
            staging = self._conn.staging_for("reserve", charge)
            rc = self._conn.call("reserve", lambda s: start_sessions(s, [name], [charge])[0])
        except Unavailable:
            if staging is not None:
                self._conn.staging.give(staging)
            self._settle(key, None)
            raise TierUnavailableError("mooncake: server unavailable") from None
        if rc != 0:
            self._conn.staging.give(staging)
            raise self._refusal(key, rc, "put start")
        hlen = charge - nbytes
        return Reservation(key, nbytes, seg, staging[hlen:charge], _Open(staging, hlen, charge))

    def commit(self, reservation: Reservation, ok: bool = True) -> bool:
        res, slot = reservation, reservation.slot
        if slot is None:
            raise ValueError(f"mooncake: no open reservation for chunk {res.key.hex()}")
        assert isinstance(slot, _Open)
        res.slot = None
        del res.buffer  # a view of a pooled buffer: not the caller's after this
        name = self._name(res.key)
        if not ok:
            self._conn.staging.give(slot.staging)
            self._revoke(name)
            return self._settle(res.key, None)
        payload = slot.staging[slot.header_len : slot.charge]
        header = ObjectHeader.for_payload(res.key, memoryview(payload.numpy()), res.segment_bytes)
        memoryview(slot.staging.numpy())[: slot.header_len] = header.encode()
        staging, size = slot.staging, slot.charge

        def upload(s: MooncakeDistributedStore) -> int:
            sent = s.batch_put_from_multi_buffer_ranges([name], [[staging.data_ptr()]], [[size]], [[0]])[0]
            if sent != size:
                s.batch_put_session_revoke([name])
                return sent if sent < 0 else -1
            return s.batch_put_session_end([name])[0]

        try:
            rc = self._conn.call("commit", upload, staging=staging)
        except Unavailable:
            self._revoke(name)
            return self._settle(res.key, None)
        self._conn.staging.give(slot.staging)
        if rc != 0:
            self.stats.errors += 1
            log.warning("mooncake: commit of chunk %s failed: %s", res.key.hex(), code_name(rc))
            return self._settle(res.key, None)
        return self._wrote(res.key, header.nbytes)

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[object],
                 segment_bytes: int | None = None, *,
                 fmts: Sequence[KVFormat | None] | None = None) -> list[PutOutcome]:
        """Like :meth:`Tier.put_many`, in one call into Mooncake: one put session start and one
        end for all, the objects sent from where they lie in growing groups while this thread
        checksums the next group (:class:`~kvtier.tiers.mooncake_calls.Relay`). With a codec,
        KV entries (``fmts``) are encoded first, on this thread, and their frames sent."""
        srcs = self._batch_data(keys, datas)
        payloads = self._payloads(keys, srcs, segment_bytes, fmts)
        if payloads is None:
            return super().put_many(keys, srcs, segment_bytes, fmts=fmts)
        checked = [self._check_request(k, p.data.numel(), p.segment_bytes, p.coding is not None)
                   for k, p in zip(keys, payloads, strict=True)]
        results: list[PutOutcome] = [False] * len(keys)
        todo: list[int] = []
        for i, (key, _, charge) in enumerate(checked):
            try:
                self._charge(key, charge)
                todo.append(i)
            except (TierFullError, EntryExistsError) as exc:
                results[i] = exc
        if not todo:
            return results
        names, sizes = [self._name(checked[i][0]) for i in todo], [checked[i][2] for i in todo]
        batch = [payloads[i].data for i in todo]
        spans, at = [], 0
        for src, size in zip(batch, sizes, strict=True):
            hlen = size - src.numel()
            spans.append((at, hlen))
            at += hlen + (src.numel() if src.numel() < ZERO_COPY_MIN else 0)
        relay, failure = Relay(len(todo)), []

        def prepare(j: int) -> None:
            """Header (and a small payload) of object ``j`` into ``buf``."""
            key, seg, _ = checked[todo[j]]
            payload = memoryview(batch[j].numpy()).cast("B")
            (pos, hlen), n = spans[j], len(payload)
            view = memoryview(buf.numpy())  # memoryview copies: no torch kernel for a memcpy
            view[pos : pos + hlen] = ObjectHeader.for_payload(key, payload, seg, payloads[todo[j]].coding).encode()
            if n < ZERO_COPY_MIN:
                view[pos + hlen : pos + hlen + n] = payload

        def checksum() -> None:
            failed = relay.feed(prepare, deadline)
            if failed is not None:
                failure.append(failed)

        staging = self._conn.staging
        try:
            buf = self._conn.staging_for("put", at)
            deadline = time.monotonic() + self.config.timeout_s
            codes = self._conn.call(
                "put", lambda s: upload(s, staging, buf, spans, names, batch, sizes, relay), staging=buf,
                codes=lambda _: (), during=checksum)  # an outage fails only the entries it hit
        except BaseException as exc:  # Unavailable, or a bug: either way nothing is charged after
            for i in todo:
                self._settle(checked[i][0], None)
                results[i] = TierUnavailableError("mooncake: server unavailable")
            if isinstance(exc, Unavailable):
                return results
            raise
        staging.give(buf)
        outage = next((rc for _, rc in codes if is_outage(rc)), None)
        if outage is not None:
            self._conn.health.failed("put", code_name(outage))
        for i, (opened, rc) in zip(todo, codes, strict=True):
            key = checked[i][0]
            if not opened:
                results[i] = self._refusal(key, rc, "put")
            elif rc != 0:
                self.stats.errors += 1
                log.warning("mooncake: put of chunk %s failed: %s", key.hex(), code_name(rc))
                results[i] = self._settle(key, None)
            else:
                results[i] = self._wrote(key, payloads[i].data.numel(), payloads[i].coding)
        if failure:  # the objects checksummed before it were stored
            raise failure[0]
        return results

    def _wrote(self, key: ChunkKey, nbytes: int, coding: Coding | None = None) -> bool:
        """A write of ``nbytes`` of payload (a codec's frames, with ``coding``) went through."""
        self.stats.writes += 1
        self.stats.bytes_written += nbytes
        return self._settle(key, nbytes if coding is None else coding.raw_nbytes, coding is not None)

    def _revoke(self, name: str) -> None:
        try:
            self._conn.call("revoke", lambda s: s.batch_put_session_revoke([name])[0])
        except Unavailable:
            pass  # the master discards an unfinished put session by itself
