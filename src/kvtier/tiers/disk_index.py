"""What a :class:`~kvtier.tiers.disk.DiskTier` holds: its directory (made, locked and scanned
for the chunk files in it when it opens), the index of those files and the bytes they take,
lookups in it, and deletes (files unlinked by a background thread)."""

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

from kvtier.core.codec_choice import choose_codec, figures_from
from kvtier.core.keys import MAX_TENANT_BYTES, ChunkKey
from kvtier.tiers.base import PAGE, Tier, round_up
from kvtier.tiers.codec_types import KVFormat
from kvtier.tiers.codecs import measure
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.disk_format import (
    _SUFFIX,
    MAX_HEADER_BYTES,
    _decode_header,
    _Entry,
    header_len_for,
)
from kvtier.tiers.disk_io import _BufferPool, _full_preadv, _full_pwritev

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DiskIndex(Tier):
    """The directory, index and deletes of :class:`~kvtier.tiers.disk.DiskTier`; its write and
    read paths are :class:`~kvtier.tiers.disk_writes.DiskWrites` and
    :class:`~kvtier.tiers.disk_reads.DiskReads`."""

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

    # -- lookups ------------------------------------------------------------------------------
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

    # -- deletes ------------------------------------------------------------------------------
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
