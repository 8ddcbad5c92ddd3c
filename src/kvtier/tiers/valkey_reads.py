"""The read path of the Valkey tier: a chunk's header and payload (or the range asked for) in
one round trip, verified; a batch of reads in one pipeline; what a missing object means."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from kvtier.core.keys import ChunkKey
from kvtier.tiers import valkey_lua as lua
from kvtier.tiers.base import check_key
from kvtier.tiers.remote_format import CorruptObject, ObjectHeader
from kvtier.tiers.valkey_index import ValkeyIndex
from kvtier.tiers.valkey_io import Unavailable


class ValkeyReads(ValkeyIndex):
    """How :class:`~kvtier.tiers.valkey.ValkeyTier` reads chunks."""

    def get(
        self,
        key: ChunkKey,
        out: torch.Tensor | None = None,
        offset: int = 0,
        length: int | None = None,
    ) -> torch.Tensor | None:
        key = check_key(key)
        hkey, dkey = self._data_keys(key)
        cached = self._headers.get(key)
        whole = cached is None or (offset == 0 and length is None)
        try:
            if whole:
                raw, data = self._conn.run("get", lambda c: c.mget(hkey, dkey))
            else:
                header = ObjectHeader.decode(cached)
                length = self._check_range(header.raw_nbytes, offset, length, out)
                lo, hi = header.span(offset, length)
                args = [lo, hi - 1] if hi > lo else [1, 0]
                raw, data = self._conn.run("get", lambda c: lua.run(c, lua.READ_RANGE, [hkey, dkey], args))
                if raw != cached:  # rewritten since: read it whole
                    self._headers.pop(key, None)
                    return self.get(key, out, offset, length)
        except Unavailable:
            self.stats.misses += 1
            return None
        return self._accept(key, raw, data, whole, offset, length, out)

    def _accept(self, key: ChunkKey, raw: bytes | None, data: bytes | None, whole: bool, offset: int,
                length: int | None, out: torch.Tensor | None) -> torch.Tensor | None:
        """Verify what a read fetched (header ``raw``; ``data``: the whole payload, or the
        segments covering the range) and deliver the range, as :meth:`get` returns it."""
        if raw is None or data is None:
            return self._missing(key)
        try:
            header = ObjectHeader.decode(raw, key)
        except CorruptObject as exc:
            return self._refused(key, exc)
        length = self._check_range(header.raw_nbytes, offset, length, out)
        want_lo, want_hi = header.span(offset, length)
        if whole and len(data) != header.nbytes:
            return self._damaged(key, f"payload of {len(data)} bytes, header says {header.nbytes}")
        if whole:
            data = memoryview(data)[want_lo:want_hi]
        elif len(data) != want_hi - want_lo:
            return self._damaged(key, "payload shorter than its header says")
        self._remember_header(key, raw)
        return self._deliver(key, header, memoryview(data), want_lo, offset, length, out)

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor],
                      late: Callable[[Future], None]) -> list[bool]:
        """Like :meth:`Tier.get_many_into`. On a standalone server, one pipeline of the chunks'
        reads (one round trip), each verified as :meth:`get` verifies (a cluster pipeline has no
        MGET, which reads a chunk's header and payload at once: one ``get`` after the other
        there). ``late`` is never called: nothing writes an ``out`` after this returns."""
        self._paired(keys, outs, "outputs")
        if self.config.cluster:
            return super().get_many_into(keys, outs, late)
        keys = [check_key(k) for k in keys]
        names = [self._data_keys(k) for k in keys]

        def fetch(c) -> list:
            pipe = c.pipeline(transaction=False)
            for hkey, dkey in names:
                pipe.mget(hkey, dkey)
            return pipe.execute(raise_on_error=False)

        try:
            replies = self._conn.run("get", fetch) if keys else []
        except Unavailable:
            self.stats.misses += len(keys)
            return [False] * len(keys)
        results = []
        for key, out, reply in zip(keys, outs, replies, strict=True):
            if isinstance(reply, Exception):
                self._conn.health.refused("get", reply)
                self.stats.misses += 1
                results.append(False)
            else:
                results.append(self._accept(key, reply[0], reply[1], True, 0, None, out) is not None)
        return results

    def _missing(self, key: ChunkKey) -> None:
        """No bytes: a plain miss, or (if the index still lists the chunk) a lost object."""
        self._headers.pop(key, None)
        keys = [self._idx, self._meta, self._used_key]
        try:
            was_indexed = self._conn.run("get", lambda c: lua.run(c, lua.UNINDEX, keys, [key.hex()]))
        except Unavailable:
            was_indexed = 0
        if was_indexed:
            return self._damaged(key, "object missing from the server", corrupt=False)
        self.stats.misses += 1
        return None
