"""The read path of the SSD tier: a range of a chunk read and its segments verified (decoded,
for a chunk stored through a codec), and what a failed read does to the chunk."""

from __future__ import annotations

import errno
import logging
import os

import torch
import xxhash

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import PAGE, round_up
from kvtier.tiers.codec_types import CodecError
from kvtier.tiers.coded import decode_range
from kvtier.tiers.disk_format import _Entry
from kvtier.tiers.disk_index import DiskIndex
from kvtier.tiers.disk_io import _full_preadv

log = logging.getLogger(__name__)

_GONE = (errno.ENOENT, errno.ENOTDIR)
"""Errors of a read that mean the file is not there: the entry is dropped. Any other OSError is
the machine's (EMFILE, EIO, EFAULT, ENOMEM...): a miss that keeps the chunk."""


class DiskReads(DiskIndex):
    """How :class:`~kvtier.tiers.disk.DiskTier` reads chunks."""

    def get(
        self,
        key: ChunkKey,
        out: torch.Tensor | None = None,
        offset: int = 0,
        length: int | None = None,
    ) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        coding = entry.coding
        if coding is None:
            return self._get_stored(key, entry, out, offset, length)
        length = coding.raw_nbytes - offset if length is None else length
        f0, f1 = coding.frames_for(offset, length)
        if out is not None and (out.numel() != length or out.dtype != torch.uint8):
            raise ValueError(f"disk: out must be a uint8 tensor of {length} bytes")
        frames = self._get_stored(key, entry, None, f0 * coding.frame, (f1 - f0) * coding.frame, count=False)
        if frames is None:
            return None
        try:
            got = decode_range(coding, frames, f0, offset, length, out)
        except CodecError as exc:
            return self._damaged(key, f"undecodable frame: {exc}")
        self.stats.hits += 1
        self.stats.lossy_hits += 1
        self.stats.bytes_read += length
        return got

    def _get_stored(self, key: ChunkKey, entry: _Entry, out: torch.Tensor | None, offset: int,
                    length: int | None, count: bool = True) -> torch.Tensor | None:
        """Stored bytes ``[offset, offset + length)`` of ``entry``, every segment they touch
        verified; None (counted, a damaged file dropped) on a miss. ``count``: count a hit
        here (a coded read counts its own, in raw bytes)."""
        length = entry.nbytes - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > entry.nbytes:
            raise ValueError(f"disk: range [{offset}, {offset + length}) outside entry of {entry.nbytes} bytes")
        if out is not None and (out.numel() != length or out.dtype != torch.uint8):
            raise ValueError(f"disk: out must be a uint8 tensor of {length} bytes")
        seg = entry.segment_bytes
        s0, s1 = offset // seg, -(-(offset + length) // seg)
        lo, hi = s0 * seg, min(s1 * seg, entry.nbytes)  # payload range covering whole segments
        start, end = entry.header_len + lo, entry.header_len + hi
        astart, aend = start - start % PAGE, round_up(end)
        # Read straight into the caller's buffer when it is exactly the covered range and
        # suitably aligned; otherwise through a staging buffer.
        direct_ok = (
            out is not None
            and out.device.type == "cpu"
            and out.is_contiguous()
            and (lo, hi) == (offset, offset + length)
            and (not self._direct or (start == astart and length % PAGE == 0 and out.data_ptr() % PAGE == 0))
        )
        staging = None
        try:
            if direct_ok:
                target = memoryview(out.numpy()).cast("B")  # type: ignore[union-attr]
                pos, want = start, length
            else:
                staging = self._pool.take(aend - astart)
                target = memoryview(staging)[: aend - astart]
                pos, want = astart, aend - astart
            try:
                fd = self._open(self._path(key), os.O_RDONLY)
                try:
                    got = _full_preadv(fd, target[:want], pos)
                finally:
                    os.close(fd)
            except OSError as exc:
                if exc.errno in _GONE:
                    return self._damaged(key, f"file missing: {exc}", corrupt=False)
                return self._unreadable(key, exc)
            data = target if direct_ok else target[start - astart : end - astart]
            if got < (hi - lo if direct_ok else end - astart):
                return self._damaged(key, f"truncated ({got} bytes read)")
            for i, s in enumerate(range(s0, s1)):
                part = data[i * seg : min((i + 1) * seg, hi - lo)]
                if xxhash.xxh3_64_intdigest(part) != entry.checksums[s]:
                    return self._damaged(key, f"checksum mismatch in segment {s}")
            if not direct_ok:
                src = torch.frombuffer(data, dtype=torch.uint8)[offset - lo : offset - lo + length]
                if out is None:
                    out = src.clone()
                else:
                    out.copy_(src)
                del src
            if count:
                self.stats.hits += 1
                self.stats.bytes_read += length
            return out
        finally:
            if staging is not None:
                target.release()
                self._pool.give(staging)

    def _unreadable(self, key: ChunkKey, exc: OSError) -> None:
        """A read failed for a reason of the machine, not of the file: a miss; the chunk stays."""
        log.warning("disk: chunk %s is a miss: %s (the file is kept)", key.hex(), exc)
        self.stats.misses += 1
        self.stats.errors += 1

    def _damaged(self, key: ChunkKey, why: str, corrupt: bool = True) -> None:
        log.warning("disk: chunk %s is a miss: %s", key.hex(), why)
        self.stats.misses += 1
        self.stats.errors += 1
        if corrupt:
            self.stats.corrupt += 1
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None or key in self._deleting:
                return  # dropped by another reader meanwhile
            self._used -= entry.file_bytes
            self._deleting.add(key)  # no new copy of the key until the damaged file is gone
        self._unlinks.put(key)
