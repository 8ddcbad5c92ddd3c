"""The write path of the Valkey tier: reserve and commit (a reservation charged by a script,
then the bytes and a script that publishes them), put, and put_many's batch of uploads in one
round trip."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from valkey.exceptions import NoScriptError, ResponseError

from kvtier.core.keys import ChunkKey
from kvtier.tiers import valkey_lua as lua
from kvtier.tiers.base import (
    EntryExistsError,
    PutOutcome,
    Reservation,
    TierFullError,
    TierUnavailableError,
    as_byte_tensor,
)
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.coded import Coding
from kvtier.tiers.remote_format import ObjectHeader, segment_count
from kvtier.tiers.valkey_index import ValkeyIndex
from kvtier.tiers.valkey_io import Unavailable, Upload, bulks, overlapped

log = logging.getLogger(__name__)


_PIECE = 512 << 10
"""A put sends its payload about this many bytes (whole segments) at a time and checksums each
piece right after sending it (the last one just before: it leaves with the script call), while
its bytes are still in the core's cache and the server takes them: cheaper than checksumming the
whole payload before or after the upload (which reads it from memory again)."""


@dataclass(slots=True)
class _Put:
    """One chunk of :meth:`ValkeyTier.put_many`."""

    key: ChunkKey
    segment_bytes: int
    charge: int
    view: memoryview
    """The stored payload (a codec's frames when ``coding`` is set)."""
    coding: Coding | None = None
    tmp: str = ""
    args: list[object] = field(default_factory=list)
    """The script's keys past the fixed ones and its arguments, header last (once packed)."""


class ValkeyWrites(ValkeyIndex):
    """How :class:`~kvtier.tiers.valkey.ValkeyTier` writes chunks."""

    def _take(self, key: ChunkKey, nbytes: int, segment_bytes: int | None,
              coded: bool = False) -> tuple[ChunkKey, int, str]:
        key, seg, charge = self._check_request(key, nbytes, segment_bytes, coded)
        token = secrets.token_hex(8)
        keys = [self._used_key, self._resv, self._resvb, self._meta]
        args = [key.hex(), charge, self.capacity, int(self.config.reservation_ttl_s * 1000), token]
        self._admitted(key, self._run_or_full("reserve", lambda c: lua.run(c, lua.RESERVE, keys, args)))
        return key, seg, token

    def _run_or_full(self, what: str, fn):
        try:
            return self._conn.run(what, fn)
        except Unavailable:
            raise TierUnavailableError("valkey: server unavailable") from None

    def _admitted(self, key: ChunkKey, reply: list) -> None:
        """Act on the reply of a script that admits a write (see valkey_lua): clean up after the
        dead writers it swept, raise what reserve raises if it refused."""
        code, swept, *rest = reply
        if swept:
            self._forget_writes([ChunkKey(bytes.fromhex(h.decode())) for h in swept])
        if code == -1:
            raise EntryExistsError(f"valkey: chunk {key.hex()} is already stored or being written")
        if code == -2:
            raise TierFullError(f"valkey: {int(rest[0])} of {self.capacity} bytes in use")

    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None) -> Reservation:
        key, seg, token = self._take(key, nbytes, segment_bytes)
        staging = self._staging.take(nbytes)
        return Reservation(key, nbytes, seg, staging[:nbytes], (token, staging))

    def commit(self, reservation: Reservation, ok: bool = True) -> bool:
        res = reservation
        if res.slot is None:
            raise ValueError(f"valkey: no open reservation for chunk {res.key.hex()}")
        (token, staging), res.slot = res.slot, None  # type: ignore[misc]
        try:
            if not ok:
                self._release(res.key, token)
                return False
            return self._write(res.key, res.buffer, res.segment_bytes, token)
        finally:
            del res.buffer
            self._staging.give(staging)

    def put(self, key: ChunkKey, data: object, segment_bytes: int | None = None, *,
            fmt: KVFormat | None = None) -> bool:
        """Like :meth:`RemoteTier.put`; in a cluster, CPU data (or its frames) goes through
        ``reserve`` (without its staging copy) and ``commit``."""
        src = as_byte_tensor(data)
        if not self.config.cluster or src.numel() == 0 or (src.device.type != "cpu" and not self._encodes(fmt)):
            return super().put(key, src, segment_bytes, fmt=fmt)
        p = self._payload(src, segment_bytes, fmt)
        key, seg, token = self._take(key, p.data.numel(), p.segment_bytes, p.coding is not None)
        return self._write(key, p.data, seg, token, p.coding)

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[object],
                 segment_bytes: int | None = None, *,
                 fmts: Sequence[KVFormat | None] | None = None) -> list[PutOutcome]:
        """Like :meth:`Tier.put_many`. On a standalone server, in one round trip for all: each
        payload goes to a temporary key that expires, piece by piece, checksummed as it goes
        (see ``_PIECE``); then a script admits the chunk (as reserve does), renames the payload
        into place and stores the header, or drops the payload. A refused chunk costs its
        upload (the tier is full: the caller evicts anyway; the uploader asks first which
        chunks are there already). The next chunk goes out while the server takes one."""
        srcs = self._batch_data(keys, datas)
        payloads = None if self.config.cluster else self._payloads(keys, srcs, segment_bytes, fmts)
        if payloads is None:
            return super().put_many(keys, srcs, segment_bytes, fmts=fmts)
        puts = [_Put(*self._check_request(k, p.data.numel(), p.segment_bytes, p.coding is not None),
                     memoryview(p.data.numpy()).cast("B"), p.coding)
                for k, p in zip(keys, payloads, strict=True)]
        ttl = int(self.config.reservation_ttl_s * 1000)
        uploads = [self._upload(put, ttl) for put in puts]

        def upload(c) -> list[list | Exception]:
            out: list[list | Exception] = []
            for put, (stored, reply) in zip(puts, overlapped(c, uploads), strict=True):
                if isinstance(reply, NoScriptError) and not isinstance(stored, Exception):
                    try:
                        reply = lua.run(c, lua.PUT, self._put_keys + put.args[:3], put.args[3:])
                    except ResponseError as exc:
                        reply = exc
                failed = next((r for r in (stored, reply) if isinstance(r, Exception)), None)
                if failed is not None:  # e.g. out of memory
                    c.delete(put.tmp)
                out.append(failed if failed is not None else reply)  # type: ignore[arg-type]
            return out

        try:
            replies = self._conn.run("put", upload)
        except Unavailable:
            return [TierUnavailableError("valkey: server unavailable") for _ in puts]
        return [self._put_done(put, reply) for put, reply in zip(puts, replies, strict=True)]

    def _upload(self, put: _Put, ttl: int) -> Upload:
        """The commands of one put: the payload to ``put.tmp``, then the script call, packed
        once every piece has been sent and checksummed."""
        key, seg, view = put.key, put.segment_bytes, put.view
        hkey, dkey = self._data_keys(key)
        put.tmp = f"{dkey}.{secrets.token_hex(8)}"
        sums: list[int] = []

        def sent(part: memoryview) -> None:  # whole segments, in order
            sums.extend(ObjectHeader.for_payload(key, part, seg).checksums)

        def script_call() -> bytes:  # once the whole payload is sent
            if len(sums) != segment_count(len(view), seg):  # never publish a header that lies
                raise RuntimeError(f"valkey: {len(sums)} checksums for {segment_count(len(view), seg)} segments")
            header = ObjectHeader(key, len(view), seg, tuple(sums), put.coding)
            put.args = [put.tmp, hkey, dkey, key.hex(), put.charge, self.capacity, header.raw_nbytes,
                        header.encode()]
            return self._put_head + bulks(*put.args)

        return Upload(("SET", put.tmp, view, "PX", ttl), script_call, seg * max(1, _PIECE // seg), sent)

    def _put_done(self, put: _Put, reply: list | Exception) -> PutOutcome:
        """The outcome of one put of :meth:`put_many` from its script's reply."""
        if isinstance(reply, Exception):
            self._conn.health.refused("put", reply)
            return TierFullError(f"valkey: put refused: {reply}")
        try:
            self._admitted(put.key, reply)
        except (EntryExistsError, TierFullError) as exc:
            return exc
        if reply[0] != 1:
            self.stats.errors += 1
            log.warning("valkey: upload of chunk %s vanished before it was published", put.key.hex())
            return False
        self._remember_header(put.key, put.args[-1])  # type: ignore[arg-type]
        self.stats.writes += 1
        self.stats.bytes_written += len(put.view)
        return True

    def _write(self, key: ChunkKey, payload: torch.Tensor, seg: int, token: str,
               coding: Coding | None = None) -> bool:
        """Upload and publish a reserved chunk (``payload``: its frames when ``coding`` is set);
        False (counted, reservation released) on failure."""
        view = memoryview(payload.numpy()).cast("B")
        header = ObjectHeader.for_payload(key, view, seg, coding)
        raw = header.encode()
        hkey, dkey = self._data_keys(key)
        keys = [self._resv, self._resvb, self._idx, self._meta, self._seq]
        args = [key.hex(), token, header.raw_nbytes]

        def upload(c) -> int:
            if self.config.cluster:  # different slots: the bytes must land before the index says so
                c.mset({hkey: raw, dkey: view})
                return lua.run(c, lua.PUBLISH, keys, args)
            pipe = c.pipeline(transaction=False)  # one connection, commands run in order
            pipe.mset({hkey: raw, dkey: view})
            pipe.evalsha(lua.sha(lua.PUBLISH), len(keys), *keys, *args)
            stored, published = pipe.execute(raise_on_error=False)
            if isinstance(published, NoScriptError) and not isinstance(stored, Exception):
                published = lua.run(c, lua.PUBLISH, keys, args)
            if isinstance(stored, Exception):  # e.g. out of memory: take the entry back out
                if published == 1:
                    lua.run(c, lua.UNINDEX, [self._idx, self._meta, self._used_key], [key.hex()])
                raise stored
            if isinstance(published, Exception):
                raise published
            return published

        try:
            published = self._conn.run("write", upload)
        except Unavailable:
            published = None
        if published != 1:
            if published == 0:
                self.stats.errors += 1
                log.warning("valkey: reservation of chunk %s expired before its commit", key.hex())
            self._forget_writes([key])
            self._release(key, token)
            return False
        self._remember_header(key, raw)
        self.stats.writes += 1
        self.stats.bytes_written += header.nbytes
        return True

    def _release(self, key: ChunkKey, token: str) -> None:
        keys = [self._resv, self._resvb, self._used_key]
        try:
            self._conn.run("release", lambda c: lua.run(c, lua.RELEASE, keys, [key.hex(), token]))
        except Unavailable:
            pass  # the reservation expires by itself

    def _forget_writes(self, keys: list[ChunkKey]) -> None:
        """Delete the bytes of unpublished writes (best effort)."""
        def drop(c) -> None:
            for k in keys:
                c.delete(*self._data_keys(k))

        try:
            self._conn.run("cleanup", drop)
        except Unavailable:
            pass
