"""Local SSD tier: one file per chunk in a capacity-bounded directory.

File format (all integers little-endian)::

    header  (header_len bytes, a multiple of 4096)
        magic "KVTC", version u16 (2), flags u16, header_len u32, key 16B,
        payload_len u64, segment_bytes u64, n_segments u32, write sequence number u64,
        position u32 (the chunk's index in its sequence, 0xffffffff: unknown),
        n_segments x u64 XXH3-64 checksums (one per segment, i.e. per layer of a chunk),
        u64 XXH3-64 of all the header bytes before it, zero padding
    payload (payload_len bytes, zero-padded to a multiple of 4096)

Version 3 (written for entries stored through a codec, :mod:`kvtier.tiers.coded`) adds, after
the position, raw_nbytes u64, raw_segment_bytes u64 and the KV format (dtype code u8, kv u8,
head_dim u32), and keeps the codec's id in ``flags``;
its payload is the codec's frames, one segment each. Version 4 (written for a chunk of a tenant)
has version 3's fields (raw_nbytes 0 and no format for a raw entry) and then the tenant: its
length u16 and its UTF-8 bytes (at most :data:`MAX_TENANT_BYTES`), before the checksums; the
tenant decides where the chunk goes when it leaves SSD (the tenant's prefix of the remote tier),
after a restart too. Version 1 files (no position) are still read.

Guarantees:

- Atomic writes: bytes go to ``tmp/`` and are renamed into ``chunks/`` only when complete (with
  ``fsync`` of file and directory when configured). A process killed mid-write leaves at most a
  temporary file, removed when the directory is next opened.
- Every read verifies the checksum of every segment it touches; a missing, truncated or
  corrupted file is a miss that is logged and counted, and the damaged file is removed. Only
  damage removes a file: a read that fails for a reason of the machine (out of file descriptors,
  EIO, a fault in the destination memory) is a counted miss that keeps the chunk.
- Reopening a directory serves every chunk that was completely written.
- I/O uses page-aligned buffers with ``os.preadv``/``os.pwritev``, and ``O_DIRECT`` where the
  filesystem supports it (falling back to buffered I/O where it does not, e.g. tmpfs).
- One process owns a directory at a time (an advisory lock on ``LOCK``).
- Files are ``0600`` and directories ``0700`` by default (``mode``, ``group``): chunk files hold
  every tenant's KV.
- Deleted files are unlinked by a background thread, so that a store evicting under its lock
  does no file-system I/O there; a key being unlinked cannot be written again until it is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import queue
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xxhash

from kvtier.core.codec_choice import DEFAULT_MAX_KL, choose_codec, figures_from
from kvtier.core.keys import KEY_BYTES, MAX_TENANT_BYTES, ChunkKey
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
from kvtier.tiers.codecs import CODECS, DTYPE_NAMES, DTYPES, CodecError, KVFormat, measure
from kvtier.tiers.coded import Coding, decode_range, encode_entry

log = logging.getLogger(__name__)

MAGIC = b"KVTC"
VERSION = 2
_FIXED_V1 = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQ")
_FIXED = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQI")
_FIXED_V3 = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQIQQBBI")
_FIXED_V4 = struct.Struct(f"<4sHHI{KEY_BYTES}sQQIQIQQBBIH")
MAX_HEADER_BYTES = 16 << 20
"""A header read on reopen at most (its checksums: 8 bytes a segment)."""
_NO_POSITION = 0xFFFFFFFF
_SUFFIX = ".kvc"
_GONE = (errno.ENOENT, errno.ENOTDIR)
"""Errors of a read that mean the file is not there: the entry is dropped. Any other OSError is
the machine's (EMFILE, EIO, EFAULT, ENOMEM...): a miss that keeps the chunk."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class DiskTierConfig:
    path: str
    capacity_bytes: int
    fsync: bool = False
    """fsync each file and its directory before a write counts as done (survives power loss)."""
    o_direct: bool = True
    """Bypass the page cache where the filesystem allows it."""
    mode: int = 0o600
    """Permissions of chunk files; directories get the same plus search (0700 for 0600)."""
    group: int | None = None
    """Group id of the directory and its files (None: the owning process's)."""
    codec: str = "none"
    """Store KV chunks through this codec (``fp8``, ``int8``, ``int4``: lossy, 2-4x more chunks in
    the same bytes; see :mod:`kvtier.tiers.codecs`), or ``auto``: the one that loads fastest on
    this disk within ``max_kl`` (:mod:`kvtier.core.codec_choice`, measured when the tier opens).
    Chunks of any codec are read back."""
    max_kl: float = DEFAULT_MAX_KL
    """``auto``'s quality budget: the largest mean KL (nats) a codec may cost."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"disk path must be a non-empty path, got {self.path!r}")
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ValueError(f"disk capacity_bytes must be a positive int, got {self.capacity_bytes!r}")
        for name in ("fsync", "o_direct"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"disk {name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.mode, int) or not 0 <= self.mode <= 0o777 or self.mode & 0o600 != 0o600:
            raise ValueError(f"disk mode must be a file mode that the owner can read and write "
                             f"(like 0o600 or 0o640), got {self.mode!r}")
        if self.group is not None and (not isinstance(self.group, int) or self.group < 0):
            raise ValueError(f"disk group must be a group id, got {self.group!r}")
        if self.codec != "auto" and self.codec not in CODECS:
            raise ValueError(f"disk: codec must be one of {[*CODECS, 'auto']}, got {self.codec!r}")
        if not isinstance(self.max_kl, (int, float)) or isinstance(self.max_kl, bool) or not self.max_kl >= 0:
            raise ValueError(f"disk max_kl must be a number >= 0, got {self.max_kl!r}")

    @property
    def dir_mode(self) -> int:
        return self.mode | ((self.mode & 0o444) >> 2)


@dataclass(slots=True)
class _Entry:
    nbytes: int
    segment_bytes: int
    header_len: int
    checksums: tuple[int, ...]
    position: int | None = None
    coding: Coding | None = None
    """Set when the payload holds a codec's frames (``nbytes``/``segment_bytes`` are then the
    stored sizes, the coding has the raw ones)."""
    tenant: str = ""

    @property
    def file_bytes(self) -> int:
        return self.header_len + round_up(self.nbytes)


def header_len_for(n_segments: int, coded: bool = False, tenant_bytes: int = 0) -> int:
    """The header length of an entry of ``n_segments`` (``coded``: a codec's frames;
    ``tenant_bytes``: the UTF-8 length of its tenant, 0 for none)."""
    if tenant_bytes:
        return round_up(_FIXED_V4.size + tenant_bytes + 8 * n_segments + 8)
    return round_up((_FIXED_V3 if coded else _FIXED).size + 8 * n_segments + 8)


def tenant_bytes(tenant: str) -> bytes:
    """A tenant's name as a header holds it; ValueError if it cannot."""
    if not isinstance(tenant, str):
        raise TypeError(f"disk: a tenant is a string, got {type(tenant).__name__}")
    raw = tenant.encode()
    if len(raw) > MAX_TENANT_BYTES:
        raise ValueError(f"disk: a tenant name is at most {MAX_TENANT_BYTES} bytes, got {len(raw)}")
    return raw


def _encode_header(
    key: ChunkKey, nbytes: int, segment_bytes: int, checksums: list[int], seq: int,
    position: int | None = None, coding: Coding | None = None, tenant: str = "",
) -> bytes:
    name = tenant_bytes(tenant)
    hlen = header_len_for(len(checksums), coding is not None, len(name))
    pos = _NO_POSITION if position is None or not 0 <= position < _NO_POSITION else position
    if name:
        flags, raw_n, raw_seg, dcode, kv, hd = 0, 0, 0, 0, 0, 0
        if coding is not None:
            fmt = coding.fmt
            dcode, kv, hd = (DTYPES[fmt.dtype][0], fmt.kv, fmt.head_dim) if fmt is not None else (0, 0, 0)
            flags, raw_n, raw_seg = coding.codec_id, coding.raw_nbytes, coding.raw_seg
        body = _FIXED_V4.pack(MAGIC, 4, flags, hlen, key, nbytes, segment_bytes, len(checksums), seq, pos,
                              raw_n, raw_seg, dcode, kv, hd, len(name)) + name
    elif coding is None:
        body = _FIXED.pack(MAGIC, VERSION, 0, hlen, key, nbytes, segment_bytes, len(checksums), seq, pos)
    else:
        fmt = coding.fmt
        dcode, kv, hd = (DTYPES[fmt.dtype][0], fmt.kv, fmt.head_dim) if fmt is not None else (0, 0, 0)
        body = _FIXED_V3.pack(MAGIC, 3, coding.codec_id, hlen, key, nbytes, segment_bytes,
                              len(checksums), seq, pos, coding.raw_nbytes, coding.raw_seg, dcode, kv, hd)
    body += struct.pack(f"<{len(checksums)}Q", *checksums)
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return body.ljust(hlen, b"\0")


def _header_format(dcode: int, kv: int, head_dim: int) -> KVFormat | None:
    if dcode == 0:
        return None
    if dcode not in DTYPE_NAMES:
        raise ValueError(f"unknown KV dtype code {dcode}")
    return KVFormat(DTYPE_NAMES[dcode], head_dim, kv)  # ValueError on a bad kv or head_dim


def _decode_header(raw: bytes) -> tuple[ChunkKey, _Entry, int]:
    """Parse and check a header; returns key, entry and write sequence number, or raises
    ValueError naming what is wrong."""
    if len(raw) < _FIXED_V1.size:
        raise ValueError("header truncated")
    magic, version = struct.unpack_from("<4sH", raw)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    raw_sizes = None
    name = b""
    if version == 1:
        fixed, position = _FIXED_V1, _NO_POSITION
        _m, _v, _flags, hlen, key, nbytes, seg, nseg, seq = fixed.unpack_from(raw)
    elif version == VERSION:
        fixed = _FIXED
        _m, _v, _flags, hlen, key, nbytes, seg, nseg, seq, position = fixed.unpack_from(raw)
    elif version == 3:
        fixed = _FIXED_V3
        if len(raw) < fixed.size:
            raise ValueError("header truncated")
        _m, _v, flags, hlen, key, nbytes, seg, nseg, seq, position, raw_n, raw_seg, dcode, kv, hd = \
            fixed.unpack_from(raw)
        raw_sizes = (flags, raw_n, raw_seg, _header_format(dcode, kv, hd))
    elif version == 4:
        fixed = _FIXED_V4
        if len(raw) < fixed.size:
            raise ValueError("header truncated")
        _m, _v, flags, hlen, key, nbytes, seg, nseg, seq, position, raw_n, raw_seg, dcode, kv, hd, tlen = \
            fixed.unpack_from(raw)
        if not 0 < tlen <= MAX_TENANT_BYTES or len(raw) < fixed.size + tlen:
            raise ValueError("tenant length mismatch")
        name = bytes(raw[fixed.size : fixed.size + tlen])
        if raw_n:
            raw_sizes = (flags, raw_n, raw_seg, _header_format(dcode, kv, hd))
    else:
        raise ValueError(f"unsupported version {version}")
    start = fixed.size + len(name)  # the checksums
    if hlen != round_up(start + 8 * nseg + 8) or len(raw) < hlen:
        raise ValueError("header length mismatch")
    if seg <= 0 or nseg != -(-nbytes // seg):
        raise ValueError("segment table mismatch")
    end = start + 8 * nseg
    (stored,) = struct.unpack_from("<Q", raw, end)
    if xxhash.xxh3_64_intdigest(raw[:end]) != stored:
        raise ValueError("header checksum mismatch")
    try:
        tenant = name.decode()
    except UnicodeDecodeError:
        raise ValueError("tenant is not UTF-8") from None
    checksums = struct.unpack_from(f"<{nseg}Q", raw, start)
    pos = None if position == _NO_POSITION else position
    coding = None if raw_sizes is None else Coding.parse(raw_sizes[0], raw_sizes[1], raw_sizes[2], nbytes, seg,
                                                         raw_sizes[3])
    return ChunkKey(key), _Entry(nbytes, seg, hlen, tuple(checksums), pos, coding, tenant), seq


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
        dmode = config.dir_mode
        try:
            os.makedirs(self.root, mode=dmode, exist_ok=True)
            for d in (self.root, self._chunks, self._tmp):
                os.makedirs(d, mode=dmode, exist_ok=True)
                self._own(d, dmode)
            for i in range(256):  # fan-out directories, made once rather than per write
                sub = os.path.join(self._chunks, f"{i:02x}")
                os.makedirs(sub, mode=dmode, exist_ok=True)
                self._own(sub, dmode)
            probe = os.path.join(self._tmp, f".probe.{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise ValueError(f"disk tier directory {self.root!r} is not writable: {exc}") from exc
        self._lock_fd = os.open(os.path.join(self.root, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                config.mode)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ValueError(f"disk tier directory {self.root!r} is in use by another process") from None
        self._direct = bool(config.o_direct and _O_DIRECT)
        self._pool = _BufferPool()
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        self._reserved: dict[ChunkKey, int] = {}
        self._deleting: set[ChunkKey] = set()
        self._unlinks: queue.SimpleQueue[ChunkKey | None] = queue.SimpleQueue()
        self._unlinked = threading.Condition(self._lock)
        self._used = 0
        self._seq = 0  # write sequence: orders chunks oldest-first across restarts
        self._recover()
        self.codec = self._choose_codec() if config.codec == "auto" else config.codec
        """The codec new KV chunks are stored with (``auto`` resolved)."""
        self._unlinker = threading.Thread(target=self._unlink_loop, name="kvtier-disk-unlink", daemon=True)
        self._unlinker.start()

    def _own(self, path: str, mode: int) -> None:
        """Give a directory the configured mode and group (an existing one too)."""
        os.chmod(path, mode)
        if self.config.group is not None:
            os.chown(path, -1, self.config.group)

    def _choose_codec(self) -> str:
        """``auto``: this disk's read bandwidth (a 32 MiB file written and read back the way
        chunks are) and this machine's decode rates decide, within ``max_kl``."""
        size = 32 << 20
        probe = os.path.join(self._tmp, f".bandwidth.{os.getpid()}")
        buf = mmap.mmap(-1, size)  # not from the pool: it would keep 32 MiB for the tier's life
        try:
            view = memoryview(buf)
            fd = self._open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            try:
                _full_pwritev(fd, [view], 0)
                os.fsync(fd)
                if not self._direct:  # read the disk, not the page cache the write left
                    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                _full_preadv(fd, view, 0)
                read_Bps = size / max(time.perf_counter() - t0, 1e-6)
            finally:
                os.close(fd)
                view.release()
        except OSError as exc:
            log.warning("disk: codec auto could not measure %s (%s); storing chunks raw", self.root, exc)
            return "none"
        finally:
            buf.close()
            with contextlib.suppress(OSError):
                os.unlink(probe)
        measured = measure()
        figures = figures_from({c: r for c, (r, _) in measured.items()}, {c: b for c, (_, b) in measured.items()})
        codec = choose_codec(figures, read_Bps, self.config.max_kl)
        log.info("disk: codec auto chose %s (reads %.2f GB/s; decode GB/s %s; max_kl %g)", codec,
                 read_Bps / 1e9, {c: round(b / 1e9, 2) for c, (_, b) in measured.items()}, self.config.max_kl)
        return codec

    # -- paths and opening --------------------------------------------------------------------
    def _path(self, key: ChunkKey) -> str:
        name = key.hex()
        return os.path.join(self._chunks, name[:2], name + _SUFFIX)

    def _open(self, path: str, flags: int) -> int:
        flags |= os.O_CLOEXEC | os.O_NOFOLLOW
        if self._direct:
            try:
                return os.open(path, flags | _O_DIRECT, self.config.mode)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("disk: O_DIRECT not supported under %s; using buffered I/O", self.root)
                self._direct = False
        return os.open(path, flags, self.config.mode)

    @property
    def direct_io(self) -> bool:
        """Whether reads and writes currently bypass the page cache."""
        return self._direct

    def _recover(self) -> None:
        """Drop partial writes and index every complete chunk file, oldest first. Anything in
        the directory that is not a regular file (a FIFO, a device, a link) is skipped, never
        opened: opening a FIFO would hang the start."""
        for entry in os.scandir(self._tmp):
            if not entry.is_file(follow_symlinks=False):
                continue
            try:
                os.unlink(entry.path)
                log.info("disk: removed partial write %s", entry.name)
            except OSError:
                pass
        found: list[tuple[int, ChunkKey, _Entry]] = []
        for sub in os.scandir(self._chunks):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for item in os.scandir(sub.path):
                if not item.is_file(follow_symlinks=False):
                    log.warning("disk: skipping %s: not a regular file", item.path)
                    continue
                got = self._recover_file(item.path, item.name)
                if got is not None:
                    found.append(got)
        for seq, key, entry in sorted(found, key=lambda t: t[0]):
            self._entries[key] = entry
            self._used += entry.file_bytes
            self._seq = max(self._seq, seq)
        if self._used > self.capacity:
            log.warning(
                "disk: %s holds %d bytes, over its capacity of %d; the store will evict",
                self.root, self._used, self.capacity,
            )

    def _recover_file(self, path: str, name: str) -> tuple[int, ChunkKey, _Entry] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("disk: skipping %s: %s", path, exc)  # unreadable now is not damage
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                log.warning("disk: skipping %s: not a regular file", path)
                return None
            raw = os.pread(fd, PAGE, 0)
            hlen = struct.unpack_from("<I", raw, 8)[0] if len(raw) >= 12 else 0
            if PAGE < hlen <= min(st.st_size, MAX_HEADER_BYTES):  # a header of many segments
                raw += os.pread(fd, hlen - PAGE, PAGE)
            key, entry, seq = _decode_header(raw)
            if name != key.hex() + _SUFFIX:
                raise ValueError("file name does not match its key")
            if st.st_size != entry.file_bytes:
                raise ValueError(f"size {st.st_size} != expected {entry.file_bytes}")
        except ValueError as exc:
            log.warning("disk: dropping damaged chunk file %s: %s", path, exc)
            self.stats.corrupt += 1
            self.stats.errors += 1
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        except OSError as exc:
            log.warning("disk: skipping %s: %s", path, exc)
            self.stats.errors += 1
            return None
        finally:
            os.close(fd)
        if st.st_mode & 0o777 != self.config.mode:
            try:
                os.chmod(path, self.config.mode)  # files of an older, laxer configuration
            except OSError:
                pass
        return seq, key, entry

    # -- size ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity_bytes

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def footprint(self, nbytes: int, segment_bytes: int | None = None, coded: bool = False) -> int:
        """Bytes charged for an entry stored as given (a raw entry that this tier's codec then
        compresses is charged what it takes once framed)."""
        n = -(-nbytes // (segment_bytes or nbytes))
        # a room estimate: as large as the header of an entry of any tenant (the charge is exact)
        return max(header_len_for(n, coded), header_len_for(n, coded, MAX_TENANT_BYTES)) + round_up(nbytes)

    def position_of(self, key: ChunkKey) -> int | None:
        """The position recorded with a chunk (its index in its sequence), if any."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.position if entry else None

    # -- writes -------------------------------------------------------------------------------
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

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._entries

    def entry_bytes(self, key: ChunkKey) -> int | None:
        """Raw size of a committed entry (what a read returns), whatever it takes stored."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            return entry.coding.raw_nbytes if entry.coding else entry.nbytes

    def segment_bytes_of(self, key: ChunkKey) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            return entry.coding.raw_seg if entry.coding else entry.segment_bytes

    def format_of(self, key: ChunkKey) -> KVFormat | None:
        """The KV format a compressed entry records (None: raw, absent, or not KV)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.coding.fmt if entry is not None and entry.coding is not None else None

    def tenant_of(self, key: ChunkKey) -> str | None:
        """The tenant recorded with a committed entry ("" for none), None if absent."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.tenant

    def codec_of(self, key: ChunkKey) -> str | None:
        """The codec a committed entry is stored with (``"none"``: raw), None if absent."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else (entry.coding.codec if entry.coding else "none")

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def _delete_unpinned(self, key: ChunkKey) -> bool:
        """Forget the entry now (its space is free at once); the file is unlinked by the
        background thread, and the key cannot be written again until it is."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._used -= entry.file_bytes
        self._deleting.add(key)
        self._unlinks.put(key)
        return True

    def _unlink_loop(self) -> None:
        while (key := self._unlinks.get()) is not None:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("disk: could not delete chunk %s: %s", key.hex(), exc)
            with self._unlinked:
                self._deleting.discard(key)
                self._unlinked.notify_all()

    def wait_deleted(self, key: ChunkKey, timeout: float = 1.0) -> bool:
        """Wait until an earlier copy of ``key`` is unlinked (it can be written again then)."""
        with self._unlinked:
            return self._unlinked.wait_for(lambda: key not in self._deleting, timeout)

    def flush_deletes(self, timeout: float | None = 10.0) -> bool:
        """Wait until every deleted file is unlinked; False on timeout."""
        with self._unlinked:
            return self._unlinked.wait_for(lambda: not self._deleting, timeout)

    def close(self) -> None:
        if self._unlinker.is_alive():
            self._unlinks.put(None)
            self._unlinker.join(timeout=30)
        with self._lock:
            if self._lock_fd >= 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = -1
