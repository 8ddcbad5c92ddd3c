"""Local SSD tier: one file per chunk in a capacity-bounded directory.

The file format (a checksummed header, then the payload): :mod:`kvtier.tiers.disk_format`.

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

from kvtier.tiers.disk_reads import DiskReads
from kvtier.tiers.disk_writes import DiskWrites


class DiskTier(DiskWrites, DiskReads):
    """Capacity-bounded chunk files under ``config.path``."""

    name = "disk"
