"""What a :class:`~kvtier.tiers.mooncake.MooncakeTier` holds: its connection, and the list of
the chunks this process committed (oldest first) with the bytes they are charged; lookups, which
ask the master, and deletes."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import EntryExistsError, TierFullError, check_key
from kvtier.tiers.mooncake_calls import HEAD_PEEK
from kvtier.tiers.mooncake_io import MooncakeConnection, Unavailable, code_name
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_config import MooncakeTierConfig
from kvtier.tiers.remote_format import FIXED_BYTES, CorruptObject, ObjectHeader, peek_header_len


@dataclass(frozen=True, slots=True)
class _Listed:
    """A chunk this process committed: its raw size, its object's size (its charge), and
    whether it is stored through a codec."""

    nbytes: int
    charge: int
    coded: bool = False


class MooncakeIndex(RemoteTier):
    """The state, list and deletes of :class:`~kvtier.tiers.mooncake.MooncakeTier`; its write
    and read paths are :class:`~kvtier.tiers.mooncake_writes.MooncakeWrites` and
    :class:`~kvtier.tiers.mooncake_reads.MooncakeReads`."""

    def __init__(self, config: MooncakeTierConfig) -> None:
        super().__init__()
        self.config = config
        self._conn = MooncakeConnection(config, self.stats)
        self.health = self._conn.health
        self._entries: OrderedDict[ChunkKey, _Listed] = OrderedDict()
        self._reserved: dict[ChunkKey, int] = {}
        self._used = 0

    def _name(self, key: ChunkKey) -> str:
        return f"{self.config.prefix}:{key.hex()}"

    # -- size ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.capacity_bytes

    @property
    def used(self) -> int:
        """Bytes this process committed or reserved (see :mod:`kvtier.tiers.mooncake`)."""
        with self._lock:
            return self._used

    def _charge(self, key: ChunkKey, charge: int) -> None:
        with self._lock:
            if key in self._entries or key in self._reserved:
                raise EntryExistsError(f"mooncake: chunk {key.hex()} is already stored or being written")
            if self._used + charge > self.capacity:
                raise TierFullError(f"mooncake: {self._used} of {self.capacity} bytes in use")
            self._reserved[key] = charge
            self._used += charge

    def _settle(self, key: ChunkKey, nbytes: int | None, coded: bool = False) -> bool:
        """End a write: listed with raw size ``nbytes``, or (None) its charge returned."""
        with self._lock:
            charge = self._reserved.pop(key)
            if nbytes is None:
                self._used -= charge
            else:
                self._entries[key] = _Listed(nbytes, charge, coded)
        return nbytes is not None

    # -- lookups ------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        name = self._name(check_key(key))
        try:
            return self._conn.call("contains", lambda s: s.is_exist(name)) == 1
        except Unavailable:
            return False

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One ``batch_is_exist`` call."""
        if not keys:
            return []
        names = [self._name(check_key(k)) for k in keys]
        try:
            found = self._conn.call("contains", lambda s: s.batch_is_exist(names))
        except Unavailable:
            return [False] * len(keys)
        return [v == 1 for v in found]

    def entry_bytes(self, key: ChunkKey) -> int | None:
        with self._lock:
            known = self._entries.get(key)
        if known is not None:
            return known.nbytes if self.contains(key) else None
        name = self._name(check_key(key))
        try:
            size = self._conn.call("entry_bytes", lambda s: s.get_size(name))
            if size < FIXED_BYTES:
                return None
            raw = self._read_head(name, min(HEAD_PEEK, size))  # the whole header, mostly
            hlen = peek_header_len(raw)
            if hlen > len(raw):
                raw = self._read_head(name, min(hlen, size))
            return ObjectHeader.decode(raw, key).raw_nbytes
        except (Unavailable, CorruptObject):
            return None

    def _read_head(self, name: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of an object (one ranged read, not the whole object)."""
        head = self._conn.staging_for("entry_bytes", nbytes)
        got = self._conn.call(
            "entry_bytes",
            lambda s: s.get_into_ranges([head.data_ptr()], [[name]], [[[0]]], [[[0]]], [[[nbytes]]])[0][0][0],
            staging=head)
        try:
            if got != nbytes:
                raise CorruptObject(f"read of the header failed: {code_name(got)}")
            return head.numpy()[:nbytes].tobytes()
        finally:
            self._conn.staging.give(head)

    def keys(self) -> list[ChunkKey]:
        """Chunks this process committed, oldest first (see :mod:`kvtier.tiers.mooncake`)."""
        with self._lock:
            return list(self._entries)

    def oldest(self, n: int) -> list[ChunkKey]:
        """The first ``n`` of :meth:`keys`, from this process's own list (Mooncake lists objects
        in no order, so there is no server-side query to bound): no call to the master, and
        ``n`` steps, not a copy of the whole list."""
        n = self._check_limit(n)
        with self._lock:
            return list(itertools.islice(self._entries, n))

    # -- deletes ------------------------------------------------------------------------------
    def _delete_unpinned(self, key: ChunkKey) -> bool:
        """Removes the object for every process. ``force`` skips Mooncake's read lease: a reader
        elsewhere then fails verification rather than getting wrong bytes. A remove that does
        not reach the master leaves the chunk listed (its object is still in the pool)."""
        name = self._name(key)
        try:
            rc = self._conn.call("delete", lambda s: s.remove(name, True))
        except Unavailable:
            return False
        self._unlist(key)
        return rc == 0

    def _unlist(self, key: ChunkKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry.charge

    def _drop_damaged(self, key: ChunkKey) -> None:
        with self._lock:
            self._unlist(key)
            self._delete_unpinned(key)

    def close(self) -> None:
        self._conn.close()
