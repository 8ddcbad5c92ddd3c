"""Remote tier on Mooncake Store (``mooncake.store.MooncakeDistributedStore``, TCP or RDMA).

One chunk is one Mooncake object ``<prefix>:<key hex>`` in the :mod:`kvtier.tiers.remote` format.

What is shared and what is per process:

- Shared, in Mooncake: the objects. ``contains``, ``get``, ``entry_bytes`` and ``delete`` ask the
  master, so every process sees the chunks every other one committed. ``reserve`` opens a Mooncake
  put session (its PutStart): the object is invisible to all until ``commit`` ends the session,
  and a second writer of the same key is refused. The master discards sessions of writers that
  died.
- Per process: ``keys`` and ``used``/``capacity``. Mooncake lists objects in no order and keeps no
  counter that several clients can update atomically, so each tier object lists the chunks *it*
  committed (oldest first) and charges them to its own budget: give each process its share of
  the pool as ``capacity_bytes``. The pool's own limit shows as TierFullError from ``reserve``.
  ``oldest(n)`` (what the uploader evicts when the budget is spent) is the head of that list.
  Mooncake evicts objects by itself when the pool passes its high watermark; such a chunk becomes
  a miss and leaves this process's list on its next read.
- The bytes live in the memory of whoever mounts segments: ``global_segment_bytes`` of this
  process (gone when it exits) or a standalone ``mooncake_client``, which keeps data alive after
  a writer exits. With the default of 0 this process mounts nothing.

Every Mooncake call runs on a worker thread and is abandoned after ``timeout_s`` (Mooncake's own
RPC and transfer timeouts are 30 s). An abandoned call may still touch its buffers later, so
``get`` reads into staging buffers the tier owns (given back to the pool only once the call has
ended) and copies out after verification. ``get_many_into`` (how the store promotes chunks; also
``get_into``, a batch of one) reads the payloads of a batch straight into the callers' buffers
in one batched transfer and verifies them there, saving that copy; an abandoned one hands its
future to the caller, who keeps the buffers until it is done. Chunks stored through a codec
(``put_many`` with ``fmts`` on a tier with a ``codec``: the codec's frames, a smaller object)
are read whole into staging instead, a batch at a time, and decoded into the callers' buffers.
``put_many`` (and ``put``, a batch of one) opens the put sessions of a batch with one RPC,
sends the objects in growing groups while the caller's thread checksums the next group
(:class:`~kvtier.tiers.mooncake_calls.Relay`), and ends them with one RPC. Large writes send from the caller's tensor (a late read of it is harmless: a changed byte
fails its checksum). An abandoned write may still complete: the chunk is then in the pool but
not in this process's list.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
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
    check_key,
)
from kvtier.tiers.codecs import KVFormat
from kvtier.tiers.coded import Coding
from kvtier.tiers.mooncake_calls import (
    HEAD_PEEK,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    REPLICA_IS_NOT_READY,
    ZERO_COPY_MIN,
    Relay,
    download,
    download_whole,
    start_sessions,
    upload,
)
from kvtier.tiers.mooncake_io import MooncakeConnection, Unavailable, code_name, is_outage
from kvtier.tiers.remote import (
    FIXED_BYTES,
    CorruptObject,
    ObjectHeader,
    RemoteTier,
    peek_header_len,
)
from kvtier.tiers.remote_config import MooncakeTierConfig

__all__ = ["MooncakeTier", "MooncakeTierConfig"]

log = logging.getLogger(__name__)

STAGED_BATCH_BYTES = 64 << 20
"""Objects read whole into staging (chunks stored through a codec) go this many bytes a call
at most."""


@dataclass(frozen=True, slots=True)
class _Listed:
    """A chunk this process committed: its raw size, its object's size (its charge), and
    whether it is stored through a codec."""

    nbytes: int
    charge: int
    coded: bool = False


@dataclass(slots=True)
class _Open:
    staging: torch.Tensor
    header_len: int
    charge: int


class MooncakeTier(RemoteTier):
    """Chunks in Mooncake Store; see the module docstring for what is shared."""

    name = "mooncake"

    def __init__(self, config: MooncakeTierConfig) -> None:
        super().__init__()
        self.config = config
        self._conn = MooncakeConnection(config, self.stats)
        self.health = self._conn.health
        self._entries: OrderedDict[ChunkKey, _Listed] = OrderedDict()
        self._reserved: dict[ChunkKey, int] = {}
        self._used = 0

    def _name(self, key: ChunkKey) -> str:
        return f"{self.config.prefix}:{key.hex()}"

    # -- size ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity_bytes

    @property
    def used(self) -> int:
        """Bytes this process committed or reserved (see the module docstring)."""
        with self._lock:
            return self._used

    def _charge(self, key: ChunkKey, charge: int) -> None:
        with self._lock:
            if key in self._entries or key in self._reserved:
                raise EntryExistsError(f"mooncake: chunk {key.hex()} is already stored or being written")
            if self._used + charge > self.capacity:
                raise TierFullError(f"mooncake: {self._used} of {self.capacity} bytes in use")
            self._reserved[key] = charge
            self._used += charge

    def _settle(self, key: ChunkKey, nbytes: int | None, coded: bool = False) -> bool:
        """End a write: listed with raw size ``nbytes``, or (None) its charge returned."""
        with self._lock:
            charge = self._reserved.pop(key)
            if nbytes is None:
                self._used -= charge
            else:
                self._entries[key] = _Listed(nbytes, charge, coded)
        return nbytes is not None

    def _refusal(self, key: ChunkKey, rc: int, what: str) -> TierFullError | EntryExistsError:
        """What ``reserve`` raises for a refused Mooncake put (local charge returned)."""
        self._settle(key, None)
        if rc in (OBJECT_ALREADY_EXISTS, REPLICA_IS_NOT_READY):
            return EntryExistsError(f"mooncake: chunk {key.hex()} is already stored or being written")
        if rc != NO_AVAILABLE_HANDLE:
            self.stats.errors += 1
            log.warning("mooncake: %s of chunk %s failed: %s", what, key.hex(), code_name(rc))
        return TierFullError(f"mooncake: {what} refused: {code_name(rc)}")

    # -- writes -------------------------------------------------------------------------------
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

    # -- reads --------------------------------------------------------------------------------
    def get(
        self,
        key: ChunkKey,
        out: torch.Tensor | None = None,
        offset: int = 0,
        length: int | None = None,
    ) -> torch.Tensor | None:
        key = check_key(key)
        name = self._name(key)
        with self._lock:
            known = self._entries.get(key)
        if known is not None:  # a read that cannot succeed need not be tried
            self._check_range(known.nbytes, offset, length, out)
        try:
            size = known.charge if known else self._conn.call("get", lambda s: s.get_size(name))
            if size < 0:
                return self._missing(key, size)
            staging = self._conn.staging_for("get", size)
            got = self._conn.call("get", lambda s: s.get_into(name, staging.data_ptr(), size), staging=staging)
        except Unavailable:
            self.stats.misses += 1
            return None
        try:
            if got < 0:
                return self._missing(key, got)
            return self._accept(key, memoryview(staging.numpy())[:got], offset, length, out)
        finally:
            self._conn.staging.give(staging)

    def _accept(self, key: ChunkKey, obj: memoryview, offset: int, length: int | None,
                out: torch.Tensor | None) -> torch.Tensor | None:
        """Verify an object read whole (``obj``) and deliver raw bytes ``[offset,
        offset+length)`` of its chunk (decoded, if coded), as :meth:`get` returns them."""
        try:
            header = ObjectHeader.decode(obj, key)
        except CorruptObject as exc:
            return self._refused(key, exc)
        if len(obj) != header.object_bytes:
            return self._damaged(key, f"object of {len(obj)} bytes, header says {header.object_bytes}")
        length = self._check_range(header.raw_nbytes, offset, length, out)
        lo, hi = header.span(offset, length)
        return self._deliver(key, header, obj[header.length + lo : header.length + hi], lo, offset, length, out)

    def get_into(self, key: ChunkKey, out: torch.Tensor, late: Callable[[Future], None]) -> bool:
        """Like :meth:`Tier.get_into`: :meth:`get_many_into` of one entry."""
        return self.get_many_into([key], [out], late)[0]

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor],
                      late: Callable[[Future], None]) -> list[bool]:
        """Like :meth:`Tier.get_many_into`, in one call into Mooncake: each payload lands
        straight in its ``out`` (registered with Mooncake by the call itself, for its duration)
        and is verified where it lies; the headers go to a staging buffer. A call given up on a
        timeout hands its future to ``late``. An entry whose ``out`` cannot take such a read
        (not a contiguous CPU uint8 tensor, sharing a page with registered memory), whose object
        does not have the expected shape, or that is stored through a codec, is read whole into
        staging instead (:meth:`_get_staged`: batched, then verified, decoded and copied)."""
        self._paired(keys, outs, "outputs")
        keys = [check_key(k) for k in keys]
        with self._lock:
            known = [self._entries.get(k) for k in keys]
        for k, out in zip(known, outs, strict=True):
            if k is not None:  # a read that cannot succeed need not be tried
                self._check_range(k.nbytes, 0, None, out)
        direct = [i for i, out in enumerate(outs)
                  if isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.uint8
                  and out.is_contiguous() and out.numel() > 0 and not (known[i] and known[i].coded)]
        results = [False] * len(keys)
        staged: dict[int, int | None] = {i: None if k is None else k.charge for i, k in enumerate(known)}
        for i in direct:
            del staged[i]
        if direct:
            names = [self._name(keys[i]) for i in direct]
            sizes = [None if known[i] is None else known[i].charge for i in direct]  # type: ignore[union-attr]
            targets = [outs[i] for i in direct]
            try:
                head = self._conn.staging_for("get", HEAD_PEEK * len(direct))
                got = self._conn.call("get", lambda s: download(s, head, names, sizes, targets), late,
                                      staging=head, codes=lambda r: [c for pair in r for c in pair])
            except Unavailable:
                self.stats.misses += len(direct)
                got = None
            if got is not None:
                try:
                    view = memoryview(head.numpy())
                    for j, (i, (size, rc)) in enumerate(zip(direct, got, strict=True)):
                        ok = self._verify(keys[i], view[j * HEAD_PEEK : (j + 1) * HEAD_PEEK], size, rc, outs[i])
                        if ok is None:
                            staged[i] = size
                        else:
                            results[i] = ok
                finally:
                    self._conn.staging.give(head)
        if staged:
            idx = sorted(staged)
            got_staged = self._get_staged([keys[i] for i in idx], [outs[i] for i in idx], [staged[i] for i in idx])
            for i, ok in zip(idx, got_staged, strict=True):
                results[i] = ok
        return results

    def _verify(self, key: ChunkKey, head: memoryview, size: int, got: int | None, out: torch.Tensor) -> bool | None:
        """Check one read of :meth:`get_many_into`: its header (in ``head``) and the payload in
        ``out``. None: it could not be read that way (a staged read says what is wrong)."""
        n = out.numel()
        if size < 0:
            return self._missing(key, size) is not None
        if got is None:
            return None
        if got < 0:
            return self._missing(key, got) is not None
        hlen = size - n
        try:
            if peek_header_len(head) != hlen:  # another payload size
                return None
            header = ObjectHeader.decode(head[:hlen], key)
        except CorruptObject as exc:
            return self._refused(key, exc) is not None
        if header.coding is not None:  # frames as large as the raw chunk: to be decoded
            return None
        if got != size or header.nbytes != n:
            return self._damaged(key, f"read {got} of {size} bytes, header says {header.object_bytes}") is not None
        bad = header.bad_segment(memoryview(out.numpy()), 0)
        if bad is not None:
            return self._damaged(key, f"checksum mismatch in segment {bad}") is not None
        self.stats.hits += 1
        self.stats.bytes_read += n
        return True

    def _get_staged(self, keys: list[ChunkKey], outs: list[torch.Tensor], sizes: list[int | None]) -> list[bool]:
        """Objects of ``sizes`` (None: not known, asked first, in one call) read whole into
        staging buffers, :data:`STAGED_BATCH_BYTES` a call at most, each then delivered into its
        ``out`` as :meth:`get` delivers it. A call given up on writes only into its staging
        buffer (back in the pool once it has ended): no ``out`` is written after this returns."""
        names = [self._name(k) for k in keys]
        unknown = [j for j, size in enumerate(sizes) if size is None]
        if unknown:
            try:
                asked = self._conn.call("get", lambda s: [s.get_size(names[j]) for j in unknown])
            except Unavailable:
                self.stats.misses += len(unknown)
                asked = [None] * len(unknown)
            sizes = list(sizes)
            for j, size in zip(unknown, asked, strict=True):
                sizes[j] = size
        results = [False] * len(keys)
        group: list[int] = []
        total = 0
        for j, size in enumerate(sizes):
            if size is None:  # the server was unavailable: counted
                continue
            if size < 0:
                self._missing(keys[j], size)
                continue
            if group and total + size > STAGED_BATCH_BYTES:
                self._read_staged(keys, outs, names, sizes, group, results)  # type: ignore[arg-type]
                group, total = [], 0
            group.append(j)
            total += size
        if group:
            self._read_staged(keys, outs, names, sizes, group, results)  # type: ignore[arg-type]
        return results

    def _read_staged(self, keys: list[ChunkKey], outs: list[torch.Tensor], names: list[str], sizes: list[int],
                     group: list[int], results: list[bool]) -> None:
        """One batched read of :meth:`_get_staged`: entries ``group``, results into ``results``."""
        part_names, part_sizes = [names[j] for j in group], [sizes[j] for j in group]
        try:
            buf = self._conn.staging_for("get", sum(part_sizes))
            got = self._conn.call("get", lambda s: download_whole(s, buf, part_names, part_sizes), staging=buf)
        except Unavailable:
            self.stats.misses += len(group)
            return
        try:
            view, at = memoryview(buf.numpy()), 0
            for j, size, rc in zip(group, part_sizes, got, strict=True):
                if rc < 0:
                    self._missing(keys[j], rc)
                else:
                    results[j] = self._accept(keys[j], view[at : at + rc], 0, None, outs[j]) is not None
                at += size
        finally:
            self._conn.staging.give(buf)

    def _missing(self, key: ChunkKey, rc: int) -> None:
        if rc in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            with self._lock:
                lost = self._entries.pop(key, None)
                if lost is not None:
                    self._used -= lost.charge
            if lost is None:
                self.stats.misses += 1
                return None
            return self._damaged(key, "object gone from the pool (evicted or lost)", corrupt=False)
        return self._damaged(key, f"read failed: {code_name(rc)}", corrupt=False)

    def contains(self, key: ChunkKey) -> bool:
        name = self._name(check_key(key))
        try:
            return self._conn.call("contains", lambda s: s.is_exist(name)) == 1
        except Unavailable:
            return False

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One ``batch_is_exist`` call."""
        if not keys:
            return []
        names = [self._name(check_key(k)) for k in keys]
        try:
            found = self._conn.call("contains", lambda s: s.batch_is_exist(names))
        except Unavailable:
            return [False] * len(keys)
        return [v == 1 for v in found]

    def entry_bytes(self, key: ChunkKey) -> int | None:
        with self._lock:
            known = self._entries.get(key)
        if known is not None:
            return known.nbytes if self.contains(key) else None
        name = self._name(check_key(key))
        try:
            size = self._conn.call("entry_bytes", lambda s: s.get_size(name))
            if size < FIXED_BYTES:
                return None
            raw = self._read_head(name, min(HEAD_PEEK, size))  # the whole header, mostly
            hlen = peek_header_len(raw)
            if hlen > len(raw):
                raw = self._read_head(name, min(hlen, size))
            return ObjectHeader.decode(raw, key).raw_nbytes
        except (Unavailable, CorruptObject):
            return None

    def _read_head(self, name: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of an object (one ranged read, not the whole object)."""
        head = self._conn.staging_for("entry_bytes", nbytes)
        got = self._conn.call(
            "entry_bytes",
            lambda s: s.get_into_ranges([head.data_ptr()], [[name]], [[[0]]], [[[0]]], [[[nbytes]]])[0][0][0],
            staging=head)
        try:
            if got != nbytes:
                raise CorruptObject(f"read of the header failed: {code_name(got)}")
            return head.numpy()[:nbytes].tobytes()
        finally:
            self._conn.staging.give(head)

    def keys(self) -> list[ChunkKey]:
        """Chunks this process committed, oldest first (see the module docstring)."""
        with self._lock:
            return list(self._entries)

    def oldest(self, n: int) -> list[ChunkKey]:
        """The first ``n`` of :meth:`keys`, from this process's own list (Mooncake lists objects
        in no order, so there is no server-side query to bound): no call to the master, and
        ``n`` steps, not a copy of the whole list."""
        n = self._check_limit(n)
        with self._lock:
            return list(itertools.islice(self._entries, n))

    # -- deletes ------------------------------------------------------------------------------
    def _delete_unpinned(self, key: ChunkKey) -> bool:
        """Removes the object for every process. ``force`` skips Mooncake's read lease: a reader
        elsewhere then fails verification rather than getting wrong bytes. A remove that does
        not reach the master leaves the chunk listed (its object is still in the pool)."""
        name = self._name(key)
        try:
            rc = self._conn.call("delete", lambda s: s.remove(name, True))
        except Unavailable:
            return False
        self._unlist(key)
        return rc == 0

    def _unlist(self, key: ChunkKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry.charge

    def _drop_damaged(self, key: ChunkKey) -> None:
        with self._lock:
            self._unlist(key)
            self._delete_unpinned(key)

    def close(self) -> None:
        self._conn.close()
