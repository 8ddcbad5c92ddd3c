"""What a :class:`~kvtier.tiers.valkey.ValkeyTier` holds: its connection, the names of its keys
on the server (the index, the budget, the reservations, a chunk's header and payload), recent
headers; the budget, lookups in the index, and deletes."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.keys import ChunkKey
from kvtier.tiers import valkey_lua as lua
from kvtier.tiers.base import check_key
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_buffers import BufferPool
from kvtier.tiers.remote_config import ValkeyTierConfig
from kvtier.tiers.valkey_io import Unavailable, ValkeyConnection, bulks


class ValkeyIndex(RemoteTier):
    """The state, index and deletes of :class:`~kvtier.tiers.valkey.ValkeyTier`; its write and
    read paths are :class:`~kvtier.tiers.valkey_writes.ValkeyWrites` and
    :class:`~kvtier.tiers.valkey_reads.ValkeyReads`."""

    def __init__(self, config: ValkeyTierConfig) -> None:
        super().__init__()
        self.config = config
        p = config.prefix
        self._idx, self._meta, self._used_key = f"{{{p}}}:idx", f"{{{p}}}:meta", f"{{{p}}}:used"
        self._seq, self._resv, self._resvb = f"{{{p}}}:seq", f"{{{p}}}:resv", f"{{{p}}}:resvb"
        self._put_keys = [self._used_key, self._resv, self._resvb, self._meta, self._idx, self._seq]
        # the fixed head of a put's script call, packed once: 3 + 9 keys + 5 arguments
        self._put_head = b"*17\r\n" + bulks("EVALSHA", lua.sha(lua.PUT), 9, *self._put_keys)
        self._conn = ValkeyConnection(config, self.stats)
        self.health = self._conn.health
        self._staging = BufferPool()
        self._headers: dict[ChunkKey, bytes] = {}  # recent headers, for one-trip ranged reads
        self._last_used = 0

    def _data_keys(self, key: ChunkKey) -> tuple[str, str]:
        tag = f"{{{self.config.prefix}:{key.hex()}}}"
        return f"{tag}:h", f"{tag}:d"

    def _remember_header(self, key: ChunkKey, raw: bytes) -> None:
        with self._lock:
            if len(self._headers) >= 4096:
                self._headers.pop(next(iter(self._headers)), None)
            self._headers[key] = raw

    # -- size ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity_bytes

    @property
    def used(self) -> int:
        """Bytes charged by all processes sharing the prefix (the last known figure when down)."""
        try:
            self._last_used = int(self._conn.run("used", lambda c: c.get(self._used_key)) or 0)
        except Unavailable:
            pass
        return self._last_used

    # -- lookups ------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        try:
            return self._conn.run("contains", lambda c: c.hexists(self._meta, key.hex())) is True
        except Unavailable:
            return False

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One HMGET of the index (one slot, also in a cluster)."""
        if not keys:
            return []
        fields = [check_key(k).hex() for k in keys]
        try:
            found = self._conn.run("contains", lambda c: c.hmget(self._meta, fields))
        except Unavailable:
            return [False] * len(keys)
        return [v is not None for v in found]

    def entry_bytes(self, key: ChunkKey) -> int | None:
        try:
            v = self._conn.run("entry_bytes", lambda c: c.hget(self._meta, key.hex()))
        except Unavailable:
            return None
        return None if v is None else int(v.split()[0])

    def keys(self) -> list[ChunkKey]:
        return self._range(-1)

    def oldest(self, n: int) -> list[ChunkKey]:
        """One ``ZRANGE idx 0 n-1``: the first ``n`` of the index, ordered by write sequence
        (one key under the ``{p}`` tag: one node also in a cluster; a tenant's prefix has its
        own index). Empty when the server is down."""
        return self._range(n - 1) if self._check_limit(n) else []

    def _range(self, last: int) -> list[ChunkKey]:
        """Index entries ``0..last`` (-1: all), oldest first."""
        try:
            members = self._conn.run("keys", lambda c: c.zrange(self._idx, 0, last))
        except Unavailable:
            return []
        return [ChunkKey(bytes.fromhex(m.decode())) for m in members]

    # -- deletes ------------------------------------------------------------------------------
    def _delete_unpinned(self, key: ChunkKey) -> bool:
        self._headers.pop(key, None)
        keys = [self._idx, self._meta, self._used_key]

        def delete(c) -> int:
            c.delete(*self._data_keys(key))  # bytes first: a crash leaves an index entry that misses
            return lua.run(c, lua.UNINDEX, keys, [key.hex()])

        try:
            return self._conn.run("delete", delete) == 1
        except Unavailable:
            return False

    def _drop_damaged(self, key: ChunkKey) -> None:
        with self._lock:
            self._delete_unpinned(key)

    def close(self) -> None:
        self._conn.close()
