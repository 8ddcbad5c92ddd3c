"""Local SSD tier: one file per chunk in a capacity-bounded directory.

File format (all integers little-endian)::

    header  (header_len bytes, a multiple of 4096)
        magic "KVTC", version u16, flags u16, header_len u32, key 16B,
        payload_len u64, segment_bytes u64, n_segments u32, write sequence number u64,
        n_segments x u64 XXH3-64 checksums (one per segment, i.e. per layer of a chunk),
        u64 XXH3-64 of all the header bytes before it, zero padding
    payload (payload_len bytes, zero-padded to a multiple of 4096)

Guarantees:

- Atomic writes: bytes go to ``tmp/`` and are renamed into ``chunks/`` only when complete (with
  ``fsync`` of file and directory when configured). A process killed mid-write leaves at most a
  temporary file, removed when the directory is next opened.
- Every read verifies the checksum of every segment it touches; a missing, truncated or
  corrupted file is a miss that is logged and counted, and the damaged file is removed.
- Reopening a directory serves every chunk that was completely written.
- I/O uses page-aligned buffers with ``os.preadv``/``os.pwritev``, and ``O_DIRECT`` where the
  filesystem supports it (falling back to buffered I/O where it does not, e.g. tmpfs).
- One process owns a directory at a time (an advisory lock on ``LOCK``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xxhash

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.tiers.base import (
    PAGE,
    EntryExistsError,
    Reservation,
    Tier,
    TierFullError,
    as_byte_tensor,
    check_key,
    round_up,
)

log = logging.getLogger(__name__)

MAGIC = b"KVTC"
VERSION = 1
_FIXED = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQ")
_SUFFIX = ".kvc"
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class DiskTierConfig:
    path: str
    capacity_bytes: int
    fsync: bool = False
    """fsync each file and its directory before a write counts as done (survives power loss)."""
    o_direct: bool = True
    """Bypass the page cache where the filesystem allows it."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"disk path must be a non-empty path, got {self.path!r}")
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ValueError(f"disk capacity_bytes must be a positive int, got {self.capacity_bytes!r}")


@dataclass(slots=True)
class _Entry:
    nbytes: int
    segment_bytes: int
    header_len: int
    checksums: tuple[int, ...]

    @property
    def file_bytes(self) -> int:
        return self.header_len + round_up(self.nbytes)


def header_len_for(n_segments: int) -> int:
    return round_up(_FIXED.size + 8 * n_segments + 8)


def _encode_header(
    key: ChunkKey, nbytes: int, segment_bytes: int, checksums: list[int], seq: int
) -> bytes:
    hlen = header_len_for(len(checksums))
    body = _FIXED.pack(MAGIC, VERSION, 0, hlen, key, nbytes, segment_bytes, len(checksums), seq)
    body += struct.pack(f"<{len(checksums)}Q", *checksums)
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return body.ljust(hlen, b"\0")


def _decode_header(raw: bytes) -> tuple[ChunkKey, _Entry, int]:
    """Parse and check a header; returns key, entry and write sequence number, or raises
    ValueError naming what is wrong."""
    if len(raw) < _FIXED.size:
        raise ValueError("header truncated")
    magic, version, _flags, hlen, key, nbytes, seg, nseg, seq = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ValueError(f"unsupported version {version}")
    if hlen != header_len_for(nseg) or len(raw) < hlen:
        raise ValueError("header length mismatch")
    if seg <= 0 or nseg != -(-nbytes // seg):
        raise ValueError("segment table mismatch")
    end = _FIXED.size + 8 * nseg
    (stored,) = struct.unpack_from("<Q", raw, end)
    if xxhash.xxh3_64_intdigest(raw[:end]) != stored:
        raise ValueError("header checksum mismatch")
    checksums = struct.unpack_from(f"<{nseg}Q", raw, _FIXED.size)
    return ChunkKey(key), _Entry(nbytes, seg, hlen, tuple(checksums)), seq


class _BufferPool:
    """Page-aligned staging buffers (anonymous mappings), reused across I/Os."""

    def __init__(self, keep: int = 8) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._kept = 0
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        size = round_up(size)
        with self._lock:
            stack = self._free.get(size)
            if stack:
                self._kept -= 1
                return stack.pop()
        return mmap.mmap(-1, size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._kept < self._keep:
                self._free.setdefault(len(buf), []).append(buf)
                self._kept += 1
                return
        try:
            buf.close()
        except BufferError:
            pass


def _full_preadv(fd: int, view: memoryview, pos: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], pos + done)
        if n == 0:
            break
        done += n
    return done


def _full_pwritev(fd: int, bufs: list[memoryview], pos: int) -> None:
    done = os.pwritev(fd, bufs, pos)
    total = sum(len(b) for b in bufs)
    if done == total:
        return
    flat = memoryview(b"".join(bufs))  # a short write: rare enough to finish the simple way
    while done < total:
        done += os.pwritev(fd, [flat[done:]], pos + done)


class DiskTier(Tier):
    """Capacity-bounded chunk files under ``config.path``."""

    name = "disk"

    def __init__(self, config: DiskTierConfig) -> None:
        super().__init__()
        self.config = config
        self.root = os.path.abspath(os.fspath(config.path))
        self._chunks = os.path.join(self.root, "chunks")
        self._tmp = os.path.join(self.root, "tmp")
        try:
            for i in range(256):  # fan-out directories, made once rather than per write
                os.makedirs(os.path.join(self._chunks, f"{i:02x}"), exist_ok=True)
            os.makedirs(self._tmp, exist_ok=True)
            probe = os.path.join(self._tmp, f".probe.{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise ValueError(f"disk tier directory {self.root!r} is not writable: {exc}") from exc
        self._lock_fd = os.open(os.path.join(self.root, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ValueError(f"disk tier directory {self.root!r} is in use by another process") from None
        self._direct = bool(config.o_direct and _O_DIRECT)
        self._pool = _BufferPool()
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        self._reserved: dict[ChunkKey, int] = {}
        self._used = 0
        self._seq = 0  # write sequence: orders chunks oldest-first across restarts
        self._recover()

    # -- paths and opening --------------------------------------------------------------------
    def _path(self, key: ChunkKey) -> str:
        name = key.hex()
        return os.path.join(self._chunks, name[:2], name + _SUFFIX)

    def _open(self, path: str, flags: int) -> int:
        if self._direct:
            try:
                return os.open(path, flags | _O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("disk: O_DIRECT not supported under %s; using buffered I/O", self.root)
                self._direct = False
        return os.open(path, flags, 0o644)

    @property
    def direct_io(self) -> bool:
        """Whether reads and writes currently bypass the page cache."""
        return self._direct

    def _recover(self) -> None:
        """Drop partial writes and index every complete chunk file, oldest first."""
        for name in os.listdir(self._tmp):
            try:
                os.unlink(os.path.join(self._tmp, name))
                log.info("disk: removed partial write %s", name)
            except OSError:
                pass
        found: list[tuple[int, ChunkKey, _Entry]] = []
        for sub in os.listdir(self._chunks):
            subdir = os.path.join(self._chunks, sub)
            if not os.path.isdir(subdir):
                continue
            for name in os.listdir(subdir):
                path = os.path.join(subdir, name)
                try:
                    with open(path, "rb") as f:
                        raw = f.read(PAGE)
                        key, entry, seq = _decode_header(raw)
                        if entry.header_len > PAGE:
                            raw += f.read(entry.header_len - PAGE)
                            key, entry, seq = _decode_header(raw)
                        st = os.fstat(f.fileno())
                    if name != key.hex() + _SUFFIX:
                        raise ValueError("file name does not match its key")
                    if st.st_size != entry.file_bytes:
                        raise ValueError(f"size {st.st_size} != expected {entry.file_bytes}")
                except (OSError, ValueError) as exc:
                    log.warning("disk: dropping damaged chunk file %s: %s", path, exc)
                    self.stats.corrupt += 1
                    self.stats.errors += 1
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                    continue
                found.append((seq, key, entry))
        for seq, key, entry in sorted(found, key=lambda t: t[0]):
            self._entries[key] = entry
            self._used += entry.file_bytes
            self._seq = max(self._seq, seq)
        if self._used > self.capacity:
            log.warning(
                "disk: %s holds %d bytes, over its capacity of %d; the store will evict",
                self.root, self._used, self.capacity,
            )

    # -- size ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity_bytes

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def footprint(self, nbytes: int, segment_bytes: int | None = None) -> int:
        return header_len_for(-(-nbytes // (segment_bytes or nbytes))) + round_up(nbytes)

    # -- writes -------------------------------------------------------------------------------
    def _take(self, key: ChunkKey, nbytes: int, segment_bytes: int | None) -> tuple[int, int]:
        """Check the request and charge its space; returns (segment bytes, bytes charged)."""
        key = check_key(key)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"disk: entry size must be a positive int, got {nbytes!r}")
        seg = nbytes if segment_bytes is None else segment_bytes
        if not isinstance(seg, int) or seg <= 0:
            raise ValueError(f"disk: segment_bytes must be a positive int, got {segment_bytes!r}")
        charge = self.footprint(nbytes, seg)
        if charge > self.capacity:
            raise ValueError(
                f"disk: entry of {nbytes} bytes ({charge} on disk) is larger than the tier's "
                f"capacity of {self.capacity} bytes"
            )
        with self._lock:
            if key in self._entries or key in self._reserved:
                raise EntryExistsError(f"disk: chunk {key.hex()} is already stored or being written")
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

    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None) -> Reservation:
        seg, charge = self._take(key, nbytes, segment_bytes)
        hlen = charge - round_up(nbytes)
        staging = self._pool.take(charge)
        payload = torch.frombuffer(staging, dtype=torch.uint8)[hlen : hlen + nbytes]
        return Reservation(key, nbytes, seg, payload, staging)

    def commit(self, reservation: Reservation, ok: bool = True) -> bool:
        key = reservation.key
        with self._lock:
            charge = self._reserved.get(key)
        if charge is None:
            raise ValueError(f"disk: no open reservation for chunk {key.hex()}")
        staging: mmap.mmap = reservation.slot  # type: ignore[assignment]
        entry = None
        try:
            if ok:
                view = memoryview(staging)
                hlen = charge - round_up(reservation.nbytes)
                try:
                    entry = self._write_file(
                        key, view[hlen : hlen + reservation.nbytes], reservation.segment_bytes,
                        header=view[:hlen], tail=view[hlen + reservation.nbytes : charge],
                    )
                finally:
                    view.release()
        finally:
            del reservation.buffer
            self._pool.give(staging)
        return self._finish(key, charge, entry)

    def put(self, key: ChunkKey, data: object, segment_bytes: int | None = None) -> bool:
        """Like :meth:`Tier.put`; page-aligned CPU data (a host-tier slot, say) is written
        straight from where it lies, without a copy through a staging buffer."""
        src = as_byte_tensor(data)
        nbytes = src.numel()
        aligned = src.device.type == "cpu" and (
            not self._direct or (src.data_ptr() % PAGE == 0 and nbytes % PAGE == 0)
        )
        if not aligned or nbytes == 0:
            return super().put(key, src, segment_bytes)
        seg, charge = self._take(key, nbytes, segment_bytes)
        hlen = charge - round_up(nbytes)
        entry = None
        header = self._pool.take(hlen)
        try:
            payload = memoryview(src.numpy()).cast("B")
            hview = memoryview(header)
            try:
                entry = self._write_file(key, payload, seg, header=hview[:hlen], tail=None)
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
    ) -> _Entry | None:
        """Checksum ``payload`` and write header, payload and padding (``tail``, zeroed) to a
        temporary file, then rename it into place. None (logged, counted) on an I/O error.
        With ``tail`` None the payload must end on a page boundary or O_DIRECT be off."""
        nbytes = len(payload)
        checksums = [xxhash.xxh3_64_intdigest(payload[i : i + seg]) for i in range(0, nbytes, seg)]
        with self._lock:
            self._seq += 1
            seq = self._seq
        raw = _encode_header(key, nbytes, seg, checksums, seq)
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
        return _Entry(nbytes, seg, len(header), tuple(checksums))

    # -- reads --------------------------------------------------------------------------------
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
                return self._damaged(key, f"unreadable: {exc}", corrupt=False)
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
            self.stats.hits += 1
            self.stats.bytes_read += length
            return out
        finally:
            if staging is not None:
                target.release()
                self._pool.give(staging)

    def _damaged(self, key: ChunkKey, why: str, corrupt: bool = True) -> None:
        log.warning("disk: chunk %s is a miss: %s", key.hex(), why)
        self.stats.misses += 1
        self.stats.errors += 1
        if corrupt:
            self.stats.corrupt += 1
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.file_bytes
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._entries

    def entry_bytes(self, key: ChunkKey) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry.nbytes if entry else None

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def _delete_unpinned(self, key: ChunkKey) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._used -= entry.file_bytes
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        return True

    def close(self) -> None:
        with self._lock:
            if self._lock_fd >= 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = -1
