"""The host arena: one page-aligned byte mapping, private or in POSIX shared memory.

The DRAM tier (:mod:`kvtier.tiers.host`) carves it into slots; the store daemon owns a shared
one (``/dev/shm/<shm_name>``) and its clients map it with :meth:`HostArena.attach` to read and
write chunk bytes in place. A shared arena is allocated in full when it is created
(``posix_fallocate``), so a ``/dev/shm`` too small for it fails there, with a message saying so,
rather than as a SIGBUS in a client's first write. On CUDA machines the arena can be registered
as pinned (page-locked) memory so host<->device copies run at full speed.

Kept apart from the tier classes: a daemon's client needs the arena and the protocol, not a tier.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat

import torch

log = logging.getLogger(__name__)

PAGE = 4096
"""Slots, extents and O_DIRECT reads are aligned to this many bytes."""
SHM_DIR = "/dev/shm"


class HostArena:
    """A page-aligned byte arena in an anonymous or shared memory mapping."""

    def __init__(self, size: int, shm_name: str | None = None, *, create: bool = True,
                 mode: int = 0o600, gid: int | None = None) -> None:
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.size = size
        self.shm_name = shm_name
        self._owner = create and shm_name is not None
        if shm_name is None:
            self._mmap = mmap.mmap(-1, size)
        else:
            if not shm_name or "/" in shm_name or shm_name in (".", ".."):
                raise ValueError(f"shared-memory arena name {shm_name!r} is not a plain name")
            path = os.path.join(SHM_DIR, shm_name)
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
            try:
                fd = os.open(path, flags, mode)
            except FileExistsError:
                raise ValueError(f"shared-memory arena {path} already exists") from None
            try:
                if create:
                    self._allocate(fd, path, size, mode, gid)
                else:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise ValueError(f"shared-memory arena {path} is not a regular file")
                    if st.st_size < size:
                        raise ValueError(f"shared-memory arena {path} is smaller than {size} bytes")
                self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED)
            except BaseException:
                if create:
                    os.unlink(path)
                raise
            finally:
                os.close(fd)
        # Through a memoryview, which every tensor over the arena keeps alive: while any view
        # exists, closing the mapping fails (BufferError) instead of unmapping memory under it.
        self.tensor = torch.frombuffer(memoryview(self._mmap), dtype=torch.uint8)
        self._registered = False

    @staticmethod
    def _allocate(fd: int, path: str, size: int, mode: int, gid: int | None) -> None:
        """Size the new arena and commit its memory now: on a tmpfs too small for it, a mapping
        that is only truncated to size faults (SIGBUS) at the first write past what fits."""
        os.fchmod(fd, mode)  # exactly the mode asked for, whatever the umask
        if gid is not None:
            os.fchown(fd, -1, gid)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                free = _shm_free()
                raise ValueError(
                    f"cannot allocate the {size} byte DRAM arena in {SHM_DIR} ({exc.strerror}; "
                    f"{free} bytes free there): enlarge {SHM_DIR} (docker run --shm-size) or lower "
                    "the host capacity") from None
            # no fallocate on this filesystem: at least check the space
            os.ftruncate(fd, size)
            if _shm_free() < size:
                raise ValueError(f"{SHM_DIR} has {_shm_free()} bytes free, the DRAM arena needs "
                                 f"{size}: enlarge it (docker run --shm-size) or lower the host capacity") from None

    @classmethod
    def attach(cls, shm_name: str, size: int) -> HostArena:
        """Map an arena another process created (ValueError, OSError if it cannot be)."""
        return cls(size, shm_name, create=False)

    def pin(self) -> bool:
        """Page-lock the arena for CUDA copies; False where CUDA is not available."""
        if self._registered or not torch.cuda.is_available():
            return self._registered
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
        self._registered = int(err) == 0
        if not self._registered:
            log.warning("cudaHostRegister of %d bytes failed (%s); host arena is pageable", self.size, err)
        return self._registered

    def close(self) -> None:
        """Unmap (every view of the arena becomes invalid: the caller must hold none) and, for
        the arena's creator, unlink it from /dev/shm."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still alive somewhere: the mapping goes with the last one
            self._mmap = None
        if self._owner and self.shm_name is not None:
            try:
                os.unlink(os.path.join(SHM_DIR, self.shm_name))
            except FileNotFoundError:
                pass
            self._owner = False


def _shm_free() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
