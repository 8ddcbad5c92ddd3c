"""The phases the I/O benchmark times (:mod:`kvtier.bench.io`), per tier and chunk size: writes
and reads through the host or disk tier, and the same bytes through each one's raw baseline."""

from __future__ import annotations

import mmap
import os

import torch

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.errors import KVTierError
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.host_config import HostTierConfig

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class BenchError(KVTierError, RuntimeError):
    """The benchmark could not measure what it claims (a miss, a failed write)."""


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(KEY_BYTES, "little"))


def _aligned(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A page-aligned, already faulted-in byte buffer and a tensor over it."""
    buf = mmap.mmap(-1, nbytes)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    tensor.fill_(0)
    return buf, tensor


class _Workload:
    """The four phases of one chunk size: ``n`` chunks of ``chunk`` bytes through ``tier``
    (``put`` from ``src_v``, ``get`` into ``dst_v``) and through the subclass's baseline."""

    def __init__(
        self, tier: Tier, chunk: int, n: int, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        self.tier, self.chunk, self.n = tier, chunk, n
        self.src_v = list(src[: chunk * n].split(chunk))
        self.dst_v = list(dst.split(chunk))

    def write(self) -> None:
        put = self.tier.put
        failed = sum(not put(_key(i), self.src_v[i]) for i in range(self.n))
        if failed:
            raise BenchError(f"{self.tier.name}: {failed} of {self.n} writes failed")

    def read(self) -> None:
        get = self.tier.get
        missed = sum(get(_key(i), out=self.dst_v[i]) is None for i in range(self.n))
        if missed:
            raise BenchError(f"{self.tier.name}: {missed} of {self.n} reads missed")

    def baseline_write(self) -> None:
        raise NotImplementedError

    def baseline_read(self) -> None:
        raise NotImplementedError

    def before_phase(self) -> None:
        """Untimed, before every timed phase."""

    def before_reads(self) -> None:
        """Untimed, after both writes and before both reads."""

    def reset(self) -> None:
        """Untimed, at the end of a round: remove what the round wrote."""
        for i in range(self.n):
            self.tier.delete(_key(i))

class _HostWork(_Workload):
    """Baseline: ``torch`` copies to and from a plain tensor as large as the tier's arena."""

    def __init__(self, chunk: int, n: int, src: torch.Tensor) -> None:
        tier = HostTier(HostTierConfig(capacity_bytes=chunk * n, pin_memory=False), chunk)
        super().__init__(tier, chunk, n, src, torch.zeros(chunk * n, dtype=torch.uint8))
        self.base_v = list(torch.zeros(chunk * n, dtype=torch.uint8).split(chunk))

    def baseline_write(self) -> None:
        for b, s in zip(self.base_v, self.src_v):
            b.copy_(s)

    def baseline_read(self) -> None:
        for d, b in zip(self.dst_v, self.base_v):
            d.copy_(b)


class _DiskWork(_Workload):
    """Baseline: one file per chunk under ``raw_dir``, raw ``pwritev``/``preadv`` from and into
    page-aligned memory, O_DIRECT exactly when the tier uses it."""

    def __init__(self, tier: DiskTier, chunk: int, n: int, src: torch.Tensor, raw_dir: str,
                 fsync: bool) -> None:
        self._dst_buf, dst = _aligned(chunk * n)
        # The tier writes from page-aligned memory like the baseline (and like the store, which
        # demotes straight from host-tier slots).
        self._src_buf, src_aligned = _aligned(chunk * n)
        src_aligned.copy_(src[: chunk * n])
        super().__init__(tier, chunk, n, src_aligned, dst)
        self.disk, self.fsync = tier, fsync
        self._raw_buf, raw = _aligned(chunk * n)
        raw.copy_(src[: chunk * n])
        self.raw_mv = [memoryview(self._raw_buf)[i * chunk : (i + 1) * chunk] for i in range(n)]
        self.dst_mv = [memoryview(self._dst_buf)[i * chunk : (i + 1) * chunk] for i in range(n)]
        self.paths = [os.path.join(raw_dir, f"{i}.raw") for i in range(n)]

    def _flags(self) -> int:
        return _O_DIRECT if self.disk.direct_io else 0

    def baseline_write(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags()
        for path, view in zip(self.paths, self.raw_mv):
            fd = os.open(path, flags, 0o644)
            try:
                done = 0
                while done < len(view):
                    done += os.pwritev(fd, [view[done:]], done)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def baseline_read(self) -> None:
        flags = os.O_RDONLY | self._flags()
        for path, view in zip(self.paths, self.dst_mv):
            fd = os.open(path, flags)
            try:
                done = 0
                while done < len(view):
                    got = os.preadv(fd, [view[done:]], done)
                    if got == 0:
                        raise BenchError(f"baseline: {path} is short ({done} bytes)")
                    done += got
            finally:
                os.close(fd)

    def before_phase(self) -> None:
        os.sync()  # the previous phase's write-back must not land in this one

    def before_reads(self) -> None:
        if self.disk.direct_io:
            return
        files = list(self.paths)
        for dirpath, _dirs, names in os.walk(self.disk.root):
            files += [os.path.join(dirpath, n) for n in names if n != "LOCK"]
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def reset(self) -> None:
        super().reset()
        for path in self.paths:
            os.unlink(path)

    def close(self) -> None:
        for view in self.raw_mv + self.dst_mv:
            view.release()
        self.dst_v.clear()
        self.src_v.clear()
        for buf in (self._raw_buf, self._dst_buf, self._src_buf):
            try:
                buf.close()
            except BufferError:  # a tensor over it is still alive; freed when collected
                pass
