"""The read path of the Mooncake tier: an object read whole into staging and verified, a batch
read straight into the callers' buffers (or whole into staging, for chunks stored through a
codec), and what a missing object means."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import check_key
from kvtier.tiers.mooncake_calls import (
    HEAD_PEEK,
    OBJECT_NOT_FOUND,
    REPLICA_IS_NOT_READY,
    download,
    download_whole,
)
from kvtier.tiers.mooncake_index import MooncakeIndex
from kvtier.tiers.mooncake_io import Unavailable, code_name
from kvtier.tiers.remote_format import CorruptObject, ObjectHeader, peek_header_len

STAGED_BATCH_BYTES = 64 << 20
"""Objects read whole into staging (chunks stored through a codec) go this many bytes a call
at most."""


class MooncakeReads(MooncakeIndex):
    """How :class:`~kvtier.tiers.mooncake.MooncakeTier` reads chunks."""

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
