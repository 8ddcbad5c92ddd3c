"""The write path of the SSD tier: reserve and commit, put (straight from page-aligned memory,
or through a staging buffer), and a chunk file written whole and renamed into place."""

from __future__ import annotations

import logging
import os

import torch
import xxhash

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import (
    PAGE,
    EntryExistsError,
    Reservation,
    TierFullError,
    as_byte_tensor,
    check_key,
    round_up,
)
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.coded import Coding, encode_entry
from kvtier.tiers.disk_format import (
    _NO_POSITION,
    _encode_header,
    _Entry,
    header_len_for,
    tenant_bytes,
)
from kvtier.tiers.disk_index import DiskIndex
from kvtier.tiers.disk_io import _full_pwritev

log = logging.getLogger(__name__)


class DiskWrites(DiskIndex):
    """How :class:`~kvtier.tiers.disk.DiskTier` writes chunks."""

    def _take(self, key: ChunkKey, nbytes: int, segment_bytes: int | None,
              coded: bool = False, tenant: str = "") -> tuple[int, int]:
        """Check the request and charge its space (exactly what its file takes); returns
        (segment bytes, bytes charged)."""
        key = check_key(key)
        name = tenant_bytes(tenant)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"disk: entry size must be a positive int, got {nbytes!r}")
        seg = nbytes if segment_bytes is None else segment_bytes
        if not isinstance(seg, int) or seg <= 0:
            raise ValueError(f"disk: segment_bytes must be a positive int, got {segment_bytes!r}")
        charge = header_len_for(-(-nbytes // seg), coded, len(name)) + round_up(nbytes)
        if charge > self.capacity:
            raise ValueError(
                f"disk: entry of {nbytes} bytes ({charge} on disk) is larger than the tier's "
                f"capacity of {self.capacity} bytes"
            )
        with self._lock:
            if key in self._entries or key in self._reserved or key in self._deleting:
                raise EntryExistsError(f"disk: chunk {key.hex()} is already stored or being written (or deleted)")
            if self._used + charge > self.capacity:
                raise TierFullError(f"disk: {self._used} of {self.capacity} bytes in use")
            self._reserved[key] = charge
            self._used += charge
        return seg, charge

    def _finish(self, key: ChunkKey, charge: int, entry: _Entry | None) -> bool:
        with self._lock:
            del self._reserved[key]
            if entry is not None:
                self._entries[key] = entry
            else:
                self._used -= charge
        return entry is not None

    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None, *,
                position: int | None = None, tenant: str = "") -> Reservation:
        """Like :meth:`Tier.reserve`; the entry is stored raw (only :meth:`put` compresses).
        ``tenant``: whose chunk it is, recorded in its header (:meth:`tenant_of`)."""
        return self._reserve(key, nbytes, segment_bytes, position, None, tenant)

    def _reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None, position: int | None,
                 coding: Coding | None, tenant: str = "") -> Reservation:
        seg, charge = self._take(key, nbytes, segment_bytes, coding is not None, tenant)
        hlen = charge - round_up(nbytes)
        staging = self._pool.take(charge)
        payload = torch.frombuffer(staging, dtype=torch.uint8)[hlen : hlen + nbytes]
        return Reservation(key, nbytes, seg, payload, (staging, coding, tenant), position)

    def commit(self, reservation: Reservation, ok: bool = True) -> bool:
        key = reservation.key
        with self._lock:
            charge = self._reserved.get(key)
        if charge is None:
            raise ValueError(f"disk: no open reservation for chunk {key.hex()}")
        staging, coding, tenant = reservation.slot  # type: ignore[misc]
        entry = None
        try:
            if ok:
                view = memoryview(staging)
                hlen = charge - round_up(reservation.nbytes)
                try:
                    entry = self._write_file(
                        key, view[hlen : hlen + reservation.nbytes], reservation.segment_bytes,
                        header=view[:hlen], tail=view[hlen + reservation.nbytes : charge],
                        position=reservation.position, coding=coding, tenant=tenant,
                    )
                finally:
                    view.release()
        finally:
            del reservation.buffer
            self._pool.give(staging)
            stored = self._finish(key, charge, entry)  # whatever happened: the charge ends
        return stored

    def put(self, key: ChunkKey, data: object, segment_bytes: int | None = None, *,
            position: int | None = None, fmt: KVFormat | None = None, tenant: str = "") -> bool:
        """Like :meth:`Tier.put`; page-aligned CPU data (a host-tier slot, say) is written
        straight from where it lies, without a copy through a staging buffer. ``position``: the
        chunk's index in its sequence, recorded in the header for the policies after a restart.
        ``fmt``: what the bytes are, when they are KV; with a codec configured such an entry is
        stored compressed (see :mod:`kvtier.tiers.coded`), anything else raw. ``tenant``: whose
        chunk it is, recorded in its header."""
        src = as_byte_tensor(data)
        coding = None
        coded = encode_entry(self.codec, src, segment_bytes, fmt)
        if coded is not None:
            src, coding = coded
            segment_bytes = coding.frame
        nbytes = src.numel()
        aligned = src.device.type == "cpu" and (
            not self._direct or (src.data_ptr() % PAGE == 0 and nbytes % PAGE == 0)
        )
        if not aligned or nbytes == 0 or coding is not None:
            res = self._reserve(key, nbytes, segment_bytes, position, coding, tenant)
            try:
                res.buffer.copy_(src)
            except BaseException:
                self.commit(res, ok=False)
                raise
            return self.commit(res, ok=True)
        seg, charge = self._take(key, nbytes, segment_bytes, tenant=tenant)
        hlen = charge - round_up(nbytes)
        entry = None
        header = self._pool.take(hlen)
        try:
            payload = memoryview(src.numpy()).cast("B")
            hview = memoryview(header)
            try:
                entry = self._write_file(key, payload, seg, header=hview[:hlen], tail=None,
                                         position=position, tenant=tenant)
            finally:
                hview.release()
        finally:
            self._pool.give(header)
            self._finish(key, charge, entry)
        return entry is not None

    def _write_file(
        self,
        key: ChunkKey,
        payload: memoryview,
        seg: int,
        header: memoryview,
        tail: memoryview | None,
        position: int | None = None,
        coding: Coding | None = None,
        tenant: str = "",
    ) -> _Entry | None:
        """Checksum ``payload`` and write header, payload and padding (``tail``, zeroed) to a
        temporary file, then rename it into place. None (logged, counted) on an I/O error.
        With ``tail`` None the payload must end on a page boundary or O_DIRECT be off."""
        nbytes = len(payload)
        checksums = [xxhash.xxh3_64_intdigest(payload[i : i + seg]) for i in range(0, nbytes, seg)]
        with self._lock:
            self._seq += 1
            seq = self._seq
        raw = _encode_header(key, nbytes, seg, checksums, seq, position, coding, tenant)
        header[:] = raw
        bufs = [header, payload]
        if tail is not None and len(tail):
            tail[:] = bytes(len(tail))
            bufs = [header, payload, tail]
        elif round_up(nbytes) != nbytes:
            bufs.append(memoryview(bytes(round_up(nbytes) - nbytes)))
        final = self._path(key)
        tmp = os.path.join(self._tmp, f"{key.hex()}.{os.getpid()}.{seq}.tmp")
        try:
            fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.fchmod(fd, self.config.mode)  # whatever the umask
                if self.config.group is not None:
                    os.fchown(fd, -1, self.config.group)
                _full_pwritev(fd, bufs, 0)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            if self.config.fsync:
                dfd = os.open(os.path.dirname(final), os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as exc:
            log.warning("disk: write of chunk %s failed: %s", key.hex(), exc)
            self.stats.errors += 1
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return None
        self.stats.writes += 1
        self.stats.bytes_written += nbytes
        pos = None if position is None or not 0 <= position < _NO_POSITION else position
        return _Entry(nbytes, seg, len(header), tuple(checksums), pos, coding, tenant)
