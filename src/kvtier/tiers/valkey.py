"""Remote tier on Valkey (standalone or cluster), shared by every kvtier process that uses the
same servers and ``prefix``.

A chunk is two keys in one slot, ``{p:h}:h`` (its header, :mod:`kvtier.tiers.remote` format) and
``{p:h}:d`` (its payload), ``p`` being the prefix and ``h`` the chunk key in hex: chunks spread
over a cluster, a write sends the caller's bytes without copying them behind a header, and a
ranged read fetches header and range atomically (one script). The index, the budget and the
reservations are keys under the ``{p}`` hash tag, changed only by the scripts of
:mod:`kvtier.tiers.valkey_lua`, atomically also in a cluster: ``keys`` (oldest first),
``contains``, ``entry_bytes``, ``used`` and the capacity budget are the same for all processes.
The index is a sorted set by write sequence: ``oldest(n)``, what the uploader evicts when the
tier is full, is one ``ZRANGE 0 n-1`` (``keys`` reads it all).

Chunks put with a ``fmt`` through a tier with a ``codec`` are stored as the codec's frames
(:mod:`kvtier.tiers.remote`, version 2 objects); ``entry_bytes`` and the index keep their raw
size, the budget is charged what they take.

Lifecycle: ``reserve`` runs a script that refuses a key already committed or being written and
charges the budget (TierFullError when it does not fit); the buffer it returns is local.
``commit`` writes header and payload, then a script publishes the chunk in the index; an entry
is invisible until then. ``put`` on a standalone server does all of it in one round trip, and
``put_many`` does a batch of puts in one round trip (the next upload goes out while the server
takes one); ``get_many_into`` reads a batch with one pipeline.
Reservations expire after ``reservation_ttl_s`` (a writer that died); the next writer returns
their charge and deletes what they wrote. Deletes remove the bytes first, then the index entry:
a crash in between leaves an index entry whose read misses and drops it. Pins are per process:
another process can delete a chunk pinned here (a read in flight keeps the verified bytes it
fetched).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import Future
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
    check_key,
)
from kvtier.tiers.codecs import KVFormat
from kvtier.tiers.coded import Coding
from kvtier.tiers.remote import BufferPool, CorruptObject, ObjectHeader, RemoteTier, segment_count
from kvtier.tiers.remote_config import ValkeyTierConfig
from kvtier.tiers.valkey_io import Unavailable, Upload, ValkeyConnection, bulks, overlapped

__all__ = ["ValkeyTier", "ValkeyTierConfig"]

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


class ValkeyTier(RemoteTier):
    """Chunks in Valkey; see the module docstring for the layout and what is shared."""

    name = "valkey"

    def __init__(self, config: ValkeyTierConfig) -> None:
        super().__init__()
        self.config = config
        p = config.prefix
        self._idx, self._meta, self._used_key = f"{{{p}}}:idx", f"{{{p}}}:meta", f"{{{p}}}:used"
        self._seq, self._resv, self._resvb = f"{{{p}}}:seq", f"{{{p}}}:resv", f"{{{p}}}:resvb"
        self._put_keys = [self._used_key, self._resv, self._resvb, self._meta, self._idx, self._seq]
        # the fixed head of a put's script call, packed once: 3 + 9 keys + 5 arguments
        self._put_head = b"*17\r\n" + bulks("EVALSHA", lua.sha(lua.PUT), 9, *self._put_keys)
        self._conn = ValkeyConnection(config, self.stats)
        self.health = self._conn.health
        self._staging = BufferPool()
        self._headers: dict[ChunkKey, bytes] = {}  # recent headers, for one-trip ranged reads
        self._last_used = 0

    def _data_keys(self, key: ChunkKey) -> tuple[str, str]:
        tag = f"{{{self.config.prefix}:{key.hex()}}}"
        return f"{tag}:h", f"{tag}:d"

    # -- size ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity_bytes

    @property
    def used(self) -> int:
        """Bytes charged by all processes sharing the prefix (the last known figure when down)."""
        try:
            self._last_used = int(self._conn.run("used", lambda c: c.get(self._used_key)) or 0)
        except Unavailable:
            pass
        return self._last_used

    # -- writes -------------------------------------------------------------------------------
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

    # -- reads --------------------------------------------------------------------------------
    def get(
        self,
        key: ChunkKey,
        out: torch.Tensor | None = None,
        offset: int = 0,
        length: int | None = None,
    ) -> torch.Tensor | None:
        key = check_key(key)
        hkey, dkey = self._data_keys(key)
        cached = self._headers.get(key)
        whole = cached is None or (offset == 0 and length is None)
        try:
            if whole:
                raw, data = self._conn.run("get", lambda c: c.mget(hkey, dkey))
            else:
                header = ObjectHeader.decode(cached)
                length = self._check_range(header.raw_nbytes, offset, length, out)
                lo, hi = header.span(offset, length)
                args = [lo, hi - 1] if hi > lo else [1, 0]
                raw, data = self._conn.run("get", lambda c: lua.run(c, lua.READ_RANGE, [hkey, dkey], args))
                if raw != cached:  # rewritten since: read it whole
                    self._headers.pop(key, None)
                    return self.get(key, out, offset, length)
        except Unavailable:
            self.stats.misses += 1
            return None
        return self._accept(key, raw, data, whole, offset, length, out)

    def _accept(self, key: ChunkKey, raw: bytes | None, data: bytes | None, whole: bool, offset: int,
                length: int | None, out: torch.Tensor | None) -> torch.Tensor | None:
        """Verify what a read fetched (header ``raw``; ``data``: the whole payload, or the
        segments covering the range) and deliver the range, as :meth:`get` returns it."""
        if raw is None or data is None:
            return self._missing(key)
        try:
            header = ObjectHeader.decode(raw, key)
        except CorruptObject as exc:
            return self._refused(key, exc)
        length = self._check_range(header.raw_nbytes, offset, length, out)
        want_lo, want_hi = header.span(offset, length)
        if whole and len(data) != header.nbytes:
            return self._damaged(key, f"payload of {len(data)} bytes, header says {header.nbytes}")
        if whole:
            data = memoryview(data)[want_lo:want_hi]
        elif len(data) != want_hi - want_lo:
            return self._damaged(key, "payload shorter than its header says")
        self._remember_header(key, raw)
        return self._deliver(key, header, memoryview(data), want_lo, offset, length, out)

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor],
                      late: Callable[[Future], None]) -> list[bool]:
        """Like :meth:`Tier.get_many_into`. On a standalone server, one pipeline of the chunks'
        reads (one round trip), each verified as :meth:`get` verifies (a cluster pipeline has no
        MGET, which reads a chunk's header and payload at once: one ``get`` after the other
        there). ``late`` is never called: nothing writes an ``out`` after this returns."""
        self._paired(keys, outs, "outputs")
        if self.config.cluster:
            return super().get_many_into(keys, outs, late)
        keys = [check_key(k) for k in keys]
        names = [self._data_keys(k) for k in keys]

        def fetch(c) -> list:
            pipe = c.pipeline(transaction=False)
            for hkey, dkey in names:
                pipe.mget(hkey, dkey)
            return pipe.execute(raise_on_error=False)

        try:
            replies = self._conn.run("get", fetch) if keys else []
        except Unavailable:
            self.stats.misses += len(keys)
            return [False] * len(keys)
        results = []
        for key, out, reply in zip(keys, outs, replies, strict=True):
            if isinstance(reply, Exception):
                self._conn.health.refused("get", reply)
                self.stats.misses += 1
                results.append(False)
            else:
                results.append(self._accept(key, reply[0], reply[1], True, 0, None, out) is not None)
        return results

    def _remember_header(self, key: ChunkKey, raw: bytes) -> None:
        with self._lock:
            if len(self._headers) >= 4096:
                self._headers.pop(next(iter(self._headers)), None)
            self._headers[key] = raw

    def _missing(self, key: ChunkKey) -> None:
        """No bytes: a plain miss, or (if the index still lists the chunk) a lost object."""
        self._headers.pop(key, None)
        keys = [self._idx, self._meta, self._used_key]
        try:
            was_indexed = self._conn.run("get", lambda c: lua.run(c, lua.UNINDEX, keys, [key.hex()]))
        except Unavailable:
            was_indexed = 0
        if was_indexed:
            return self._damaged(key, "object missing from the server", corrupt=False)
        self.stats.misses += 1
        return None

    def contains(self, key: ChunkKey) -> bool:
        try:
            return self._conn.run("contains", lambda c: c.hexists(self._meta, key.hex())) is True
        except Unavailable:
            return False

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One HMGET of the index (one slot, also in a cluster)."""
        if not keys:
            return []
        fields = [check_key(k).hex() for k in keys]
        try:
            found = self._conn.run("contains", lambda c: c.hmget(self._meta, fields))
        except Unavailable:
            return [False] * len(keys)
        return [v is not None for v in found]

    def entry_bytes(self, key: ChunkKey) -> int | None:
        try:
            v = self._conn.run("entry_bytes", lambda c: c.hget(self._meta, key.hex()))
        except Unavailable:
            return None
        return None if v is None else int(v.split()[0])

    def keys(self) -> list[ChunkKey]:
        return self._range(-1)

    def oldest(self, n: int) -> list[ChunkKey]:
        """One ``ZRANGE idx 0 n-1``: the first ``n`` of the index, ordered by write sequence
        (one key under the ``{p}`` tag: one node also in a cluster; a tenant's prefix has its
        own index). Empty when the server is down."""
        return self._range(n - 1) if self._check_limit(n) else []

    def _range(self, last: int) -> list[ChunkKey]:
        """Index entries ``0..last`` (-1: all), oldest first."""
        try:
            members = self._conn.run("keys", lambda c: c.zrange(self._idx, 0, last))
        except Unavailable:
            return []
        return [ChunkKey(bytes.fromhex(m.decode())) for m in members]

    # -- deletes ------------------------------------------------------------------------------
    def _delete_unpinned(self, key: ChunkKey) -> bool:
        self._headers.pop(key, None)
        keys = [self._idx, self._meta, self._used_key]

        def delete(c) -> int:
            c.delete(*self._data_keys(key))  # bytes first: a crash leaves an index entry that misses
            return lua.run(c, lua.UNINDEX, keys, [key.hex()])

        try:
            return self._conn.run("delete", delete) == 1
        except Unavailable:
            return False

    def _drop_damaged(self, key: ChunkKey) -> None:
        with self._lock:
            self._delete_unpinned(key)

    def close(self) -> None:
        self._conn.close()
