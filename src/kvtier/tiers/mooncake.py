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
  Mooncake evicts objects by itself when the pool passes its high watermark; such a chunk becomes
  a miss and leaves this process's list on its next read.
- The bytes live in the memory of whoever mounts segments: ``global_segment_bytes`` of this
  process (gone when it exits) or a standalone ``mooncake_client``, which keeps data alive after
  a writer exits. With the default of 0 this process mounts nothing.

Every Mooncake call runs on a worker thread and is abandoned after ``timeout_s`` (Mooncake's own
RPC and transfer timeouts are 30 s). An abandoned call may still touch its buffers later, so
``get`` reads into staging buffers the tier owns (given back to the pool only once the call has
ended) and copies out after verification. ``get_into`` (how the store promotes a chunk) reads
the payload straight into the caller's buffer and verifies it there, saving that copy; an
abandoned one hands its future to the caller, who keeps the buffer until it is done. Large
writes send from the caller's tensor (a late read of it is harmless: a changed byte fails its
checksum). An abandoned write may still complete: the chunk is then in the pool but not in this
process's list.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from mooncake.store import MooncakeDistributedStore

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import Reservation, TierFullError, as_byte_tensor, check_key
from kvtier.tiers.mooncake_io import MooncakeConnection, Unavailable, code_name
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

NO_AVAILABLE_HANDLE, INVALID_PARAMS = -200, -600
REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS = -703, -704, -705
HEAD_PEEK = 4096
"""Bytes read to learn an object's header (that of a 32-layer chunk takes 312 bytes)."""
ZERO_COPY_MIN = 64 << 10
"""Payloads from this size on are sent from the caller's memory, smaller ones copied."""


def _start_session(store: MooncakeDistributedStore, name: str, size: int) -> int:
    """Open a put session (Mooncake's PutStart). A session this client left open after a failed
    attempt (the master was down when it tried to revoke) is revoked and the start retried."""
    rc = store.batch_put_session_start([name], [size])[0]
    if rc == INVALID_PARAMS:
        store.batch_put_session_revoke([name])
        rc = store.batch_put_session_start([name], [size])[0]
    return rc


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
        self._entries: OrderedDict[ChunkKey, tuple[int, int]] = OrderedDict()  # key -> (nbytes, charge)
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
                raise ValueError(f"mooncake: chunk {key.hex()} is already stored or being written")
            if self._used + charge > self.capacity:
                raise TierFullError(f"mooncake: {self._used} of {self.capacity} bytes in use")
            self._reserved[key] = charge
            self._used += charge

    def _settle(self, key: ChunkKey, nbytes: int | None) -> bool:
        with self._lock:
            charge = self._reserved.pop(key)
            if nbytes is None:
                self._used -= charge
            else:
                self._entries[key] = (nbytes, charge)
        return nbytes is not None

    def _refuse(self, key: ChunkKey, rc: int, what: str) -> None:
        """Raise what ``reserve`` raises for a refused Mooncake put (local charge returned)."""
        self._settle(key, None)
        if rc in (OBJECT_ALREADY_EXISTS, REPLICA_IS_NOT_READY):
            raise ValueError(f"mooncake: chunk {key.hex()} is already stored or being written")
        if rc != NO_AVAILABLE_HANDLE:
            self.stats.errors += 1
            log.warning("mooncake: %s of chunk %s failed: %s", what, key.hex(), code_name(rc))
        raise TierFullError(f"mooncake: {what} refused: {code_name(rc)}")

    # -- writes -------------------------------------------------------------------------------
    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None) -> Reservation:
        key, seg, charge = self._check_request(key, nbytes, segment_bytes)
        self._charge(key, charge)
        name = self._name(key)
        staging = None
        try:
            staging = self._conn.staging_for("reserve", charge)
            rc = self._conn.call("reserve", lambda s: _start_session(s, name, charge))
        except Unavailable:
            if staging is not None:
                self._conn.staging.give(staging)
            self._settle(key, None)
            raise TierFullError("mooncake: server unavailable") from None
        if rc != 0:
            self._conn.staging.give(staging)
            self._refuse(key, rc, "put start")
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

    def put(self, key: ChunkKey, data: object, segment_bytes: int | None = None) -> bool:
        """Like :meth:`Tier.put`; CPU data is sent from where it lies (no staging copy)."""
        src = as_byte_tensor(data)
        if src.device.type != "cpu" or src.numel() == 0:
            return super().put(key, src, segment_bytes)
        key, seg, charge = self._check_request(key, src.numel(), segment_bytes)
        self._charge(key, charge)
        header = ObjectHeader.for_payload(key, memoryview(src.numpy()).cast("B"), seg)
        raw, name, n = header.encode(), self._name(key), src.numel()
        hlen = len(raw)

        def upload(s: MooncakeDistributedStore) -> tuple[bool, int]:
            """(whether the put session opened, Mooncake's code)"""
            rc = _start_session(s, name, charge)
            if rc != 0:
                return False, rc
            staging = self._conn.staging
            # Large payloads go from where they lie; small ones (which may share a page with
            # registered memory, which Mooncake refuses to register twice) through staging.
            direct = n >= ZERO_COPY_MIN and s.register_buffer(src.data_ptr(), n) == 0
            buf = staging.take(hlen if direct else charge)
            view = memoryview(buf.numpy())  # memoryview copies: no torch kernel for a memcpy
            view[:hlen] = raw
            if not direct:
                view[hlen:charge] = memoryview(src.numpy()).cast("B")
            ptrs, sizes = ([buf.data_ptr(), src.data_ptr()], [hlen, n]) if direct else ([buf.data_ptr()], [charge])
            try:
                sent = s.batch_put_from_multi_buffer_ranges([name], [ptrs], [sizes], [[0, hlen][: len(ptrs)]])[0]
            finally:
                if direct:
                    s.unregister_buffer(src.data_ptr())
                staging.give(buf)
            if sent != charge:
                s.batch_put_session_revoke([name])
                return True, sent if sent < 0 else -1
            return True, s.batch_put_session_end([name])[0]

        try:
            opened, rc = self._conn.call("put", upload)
        except Unavailable:
            self._settle(key, None)
            raise TierFullError("mooncake: server unavailable") from None
        if not opened:
            self._refuse(key, rc, "put")
        if rc != 0:
            self.stats.errors += 1
            log.warning("mooncake: put of chunk %s failed: %s", key.hex(), code_name(rc))
            return self._settle(key, None)
        return self._wrote(key, n)

    def _wrote(self, key: ChunkKey, nbytes: int) -> bool:
        self.stats.writes += 1
        self.stats.bytes_written += nbytes
        return self._settle(key, nbytes)

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
            self._check_range(known[0], offset, length, out)
        try:
            size = known[1] if known else self._conn.call("get", lambda s: s.get_size(name))
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
            view = memoryview(staging.numpy())[:got]
            try:
                header = ObjectHeader.decode(view, key)
            except CorruptObject as exc:
                return self._damaged(key, str(exc))
            if got != header.object_bytes:
                return self._damaged(key, f"object of {got} bytes, header says {header.object_bytes}")
            length = self._check_range(header.nbytes, offset, length, out)
            _, _, lo, hi = header.covering(offset, length)
            part = view[header.length + lo : header.length + hi]
            return self._deliver(key, header, part, lo, offset, length, out)
        finally:
            self._conn.staging.give(staging)

    def get_into(self, key: ChunkKey, out: torch.Tensor, late: Callable[[Future], None]) -> bool:
        """Like :meth:`Tier.get_into`: the payload lands straight in ``out`` (registered with
        Mooncake by the call itself, for its duration) and is verified where it lies; the header
        goes to a staging buffer. A call given up on a timeout hands its future to ``late``.
        Falls back to :meth:`get` (staging and a copy) where ``out`` cannot take the read."""
        key = check_key(key)
        if not (isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.uint8
                and out.is_contiguous() and out.numel() > 0):
            return super().get_into(key, out, late)
        name, n = self._name(key), out.numel()
        with self._lock:
            known = self._entries.get(key)
        if known is not None:
            self._check_range(known[0], 0, None, out)
        try:
            size = known[1] if known else self._conn.call("get", lambda s: s.get_size(name))
            if size < 0:
                return self._missing(key, size) is not None
            hlen = size - n
            if hlen < FIXED_BYTES + 16:  # not a payload of n bytes: let get() say what is wrong
                return self.get(key, out=out) is not None
            head = self._conn.staging_for("get", hlen)
        except Unavailable:
            self.stats.misses += 1
            return False

        def read(s: MooncakeDistributedStore) -> int | None:
            """Holds head and out (its closure) until it ends; None: out cannot be registered
            (it shares a page with registered memory, say)."""
            if s.register_buffer(out.data_ptr(), n) != 0:
                return None
            try:
                return s.batch_get_into_multi_buffers([name], [[head.data_ptr(), out.data_ptr()]], [[hlen, n]])[0]
            finally:
                s.unregister_buffer(out.data_ptr())

        try:
            got = self._conn.call("get", read, late, staging=head)
        except Unavailable:
            self.stats.misses += 1
            return False
        if got is None:
            self._conn.staging.give(head)
            return self.get(key, out=out) is not None
        try:
            if got < 0:
                return self._missing(key, got) is not None
            view = memoryview(head.numpy())[:hlen]
            try:
                if peek_header_len(view) != hlen:  # another payload size: let get() say what is wrong
                    return self.get(key, out=out) is not None
                header = ObjectHeader.decode(view, key)
            except CorruptObject as exc:
                return self._damaged(key, str(exc)) is not None
            if got != size or header.nbytes != n:
                return self._damaged(key, f"read {got} of {size} bytes, header says {header.object_bytes}") is not None
            bad = header.bad_segment(memoryview(out.numpy()), 0)
            if bad is not None:
                return self._damaged(key, f"checksum mismatch in segment {bad}") is not None
        finally:
            self._conn.staging.give(head)
        self.stats.hits += 1
        self.stats.bytes_read += n
        return True

    def _missing(self, key: ChunkKey, rc: int) -> None:
        if rc in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            with self._lock:
                lost = self._entries.pop(key, None)
                if lost is not None:
                    self._used -= lost[1]
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

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """One ``batch_is_exist`` call."""
        if not keys:
            return 0
        names = [self._name(check_key(k)) for k in keys]
        try:
            found = self._conn.call("contains", lambda s: s.batch_is_exist(names))
        except Unavailable:
            return 0
        return next((n for n, v in enumerate(found) if v != 1), len(keys))

    def entry_bytes(self, key: ChunkKey) -> int | None:
        with self._lock:
            known = self._entries.get(key)
        if known is not None:
            return known[0] if self.contains(key) else None
        name = self._name(check_key(key))
        try:
            size = self._conn.call("entry_bytes", lambda s: s.get_size(name))
            if size < FIXED_BYTES:
                return None
            raw = self._read_head(name, min(HEAD_PEEK, size))  # the whole header, mostly
            hlen = peek_header_len(raw)
            if hlen > len(raw):
                raw = self._read_head(name, min(hlen, size))
            return ObjectHeader.decode(raw, key).nbytes
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

    # -- deletes ------------------------------------------------------------------------------
    def _delete_unpinned(self, key: ChunkKey) -> bool:
        """Removes the object for every process. ``force`` skips Mooncake's read lease: a reader
        elsewhere then fails verification rather than getting wrong bytes."""
        name = self._name(key)
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry[1]
        try:
            rc = self._conn.call("delete", lambda s: s.remove(name, True))
        except Unavailable:
            return False
        return rc == 0

    def _drop_damaged(self, key: ChunkKey) -> None:
        with self._lock:
            self._delete_unpinned(key)

    def close(self) -> None:
        self._conn.close()
