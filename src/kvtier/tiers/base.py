"""The contract every tier implements: bytes in, bytes out, keyed by :data:`ChunkKey`.

Lifecycle of an entry (Mooncake's PutStart/PutEnd, vLLM's prepare/complete_store):

1. ``reserve(key, nbytes)`` takes space and returns a :class:`Reservation` whose ``buffer`` the
   caller fills. The entry is invisible to ``contains``/``get`` until committed. Raises
   :class:`TierFullError` when the tier has no room: the caller evicts and tries again.
2. ``commit(reservation, ok)`` makes it visible (``ok=True``) or releases everything
   (``ok=False``). A commit that fails (an I/O error) also leaves nothing behind and returns False.

Batches: ``put_many`` and ``get_many_into`` do what ``put`` and ``get_into`` do for many entries;
a remote tier does them in one round trip (one call into its client) instead of one per entry.

Reading: ``get`` copies bytes out and returns None on a miss. A miss caused by damage (missing
file, checksum mismatch) is logged and counted in :attr:`Tier.stats` and the damaged entry is
dropped; wrong bytes are never returned.

Listing: ``keys()`` is the whole index, oldest first (a remote tier reads all of it from its
server); ``oldest(n)`` is its first ``n`` in one bounded query, for making room on a hot path.

Pinning: ``pin(key)`` keeps an entry from being deleted (``delete`` raises
:class:`EntryPinnedError`) until the matching ``unpin``. Pins nest. The store pins what it reads
so that a concurrent eviction cannot pull an entry out from under a reader.

Codecs: ``put`` and ``put_many`` take ``fmt`` (a :class:`~kvtier.tiers.codec_types.KVFormat`, or
None), what the bytes are when they are KV. A tier configured with a codec (SSD, remote) stores
such entries compressed and reads them back as raw bytes (:mod:`kvtier.tiers.coded`); other
tiers ignore it.

Tiers are thread-safe. Buffers are torch ``uint8`` tensors so that copies use torch's kernels.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Self

import numpy as np
import torch

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.errors import (  # noqa: F401 - re-exported: the tier contract's errors
    EntryExistsError,
    EntryPinnedError,
    TierFullError,
    TierUnavailableError,
)
from kvtier.tiers.arena import PAGE
from kvtier.tiers.codec_types import KVFormat

PutOutcome = bool | TierFullError | EntryExistsError
"""One entry's outcome in :meth:`Tier.put_many`."""


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    deletes: int = 0
    errors: int = 0
    """I/O failures and damaged entries (each also a miss when found on read)."""
    corrupt: int = 0
    """Entries whose bytes failed their checksum or header checks."""
    lossy_hits: int = 0
    """Hits decoded from a lossy codec's frames (whatever this tier's own codec is): the KV a
    reader got is close to, not equal to, what was saved."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class Reservation:
    """Space taken for one entry; fill ``buffer`` then pass this to ``commit``."""

    key: ChunkKey
    nbytes: int
    segment_bytes: int
    buffer: torch.Tensor
    slot: object = None
    """Tier-private handle (a slot offset, a staging buffer)."""
    position: int | None = None
    """The chunk's index in its sequence, for tiers that record it (SSD: for the policies
    after a restart)."""


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align


def as_byte_tensor(data: object) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor, array or buffer, without copying when possible."""
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError("tier data must be contiguous")
        return data.reshape(-1).view(torch.uint8)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        return torch.frombuffer(bytearray(view), dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def check_key(key: object) -> ChunkKey:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise TypeError(f"a chunk key is {KEY_BYTES} bytes, got {key!r:.40}")
    return ChunkKey(key)


class Tier(ABC):
    """Capacity-bounded key -> bytes storage with two-step writes and pinning."""

    name: str = "tier"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pins: dict[ChunkKey, int] = {}
        self.stats = TierStats()

    # -- size ---------------------------------------------------------------------------------
    @property
    @abstractmethod
    def capacity(self) -> int:
        """Bytes this tier may hold, entries' overhead included."""

    @property
    @abstractmethod
    def used(self) -> int:
        """Bytes charged to committed and reserved entries."""

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @abstractmethod
    def footprint(self, nbytes: int, segment_bytes: int | None = None) -> int:
        """Bytes an entry of ``nbytes`` is charged (slot rounding, headers)."""

    # -- writes -------------------------------------------------------------------------------
    @abstractmethod
    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None) -> Reservation:
        """Take space for ``key``. ``segment_bytes`` splits the entry into independently
        checksummed, independently readable parts (one layer of a chunk); default: one part.

        Raises TierFullError (no room now), ValueError (``nbytes`` invalid or beyond this tier's
        capacity, ``key`` already stored or being written)."""

    @abstractmethod
    def commit(self, reservation: Reservation, ok: bool = True) -> bool:
        """Publish (``ok``) or abandon the reservation. Returns whether the entry is now stored."""

    def put(self, key: ChunkKey, data: object, segment_bytes: int | None = None, *,
            fmt: KVFormat | None = None) -> bool:
        """Reserve, copy ``data`` in and commit. Raises like :meth:`reserve`. ``fmt``: see the
        module docstring (ignored here: stored raw)."""
        src = as_byte_tensor(data)
        res = self.reserve(key, src.numel(), segment_bytes)
        try:
            res.buffer.copy_(src)
        except BaseException:
            self.commit(res, ok=False)
            raise
        return self.commit(res, ok=True)

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[object],
                 segment_bytes: int | None = None, *,
                 fmts: Sequence[KVFormat | None] | None = None) -> list[PutOutcome]:
        """:meth:`put` each ``(key, data)``; per entry its result, or the TierFullError or
        EntryExistsError that ``put`` of that entry alone raises. Other bad arguments (sizes,
        lengths that differ) raise ValueError before anything is written. Default: one ``put``
        after the other."""
        srcs = self._batch_data(keys, datas)
        if segment_bytes is not None and (not isinstance(segment_bytes, int) or segment_bytes <= 0):
            raise ValueError(f"{self.name}: segment_bytes must be a positive int, got {segment_bytes!r}")
        for key, src in zip(keys, srcs, strict=True):
            check_key(key)
            n = src.numel()
            if n == 0 or max(n, self.footprint(n, segment_bytes)) > self.capacity:
                raise ValueError(f"{self.name}: entry of {src.numel()} bytes does not fit a tier of "
                                 f"{self.capacity} bytes")
        results: list[PutOutcome] = []
        formats = list(fmts) if fmts is not None else [None] * len(keys)
        self._paired(keys, formats, "formats")
        for key, src, fmt in zip(keys, srcs, formats, strict=True):
            try:
                results.append(self.put(key, src, segment_bytes, fmt=fmt))
            except (TierFullError, EntryExistsError) as exc:
                results.append(exc)
        return results

    def _paired(self, keys: Sequence[ChunkKey], items: Sequence[object], what: str) -> None:
        """A batch call's ``keys`` and its ``items`` (entries, outputs) must pair up."""
        if len(keys) != len(items):
            raise ValueError(f"{self.name}: a batch of {len(keys)} keys and {len(items)} {what}")

    def _batch_data(self, keys: Sequence[ChunkKey], datas: Sequence[object]) -> list[torch.Tensor]:
        """The entries of a ``put_many`` as flat byte tensors (see :func:`as_byte_tensor`)."""
        self._paired(keys, datas, "entries")
        return [as_byte_tensor(d) for d in datas]

    # -- reads --------------------------------------------------------------------------------
    @abstractmethod
    def get(
        self,
        key: ChunkKey,
        out: torch.Tensor | None = None,
        offset: int = 0,
        length: int | None = None,
    ) -> torch.Tensor | None:
        """Bytes ``[offset, offset+length)`` of the entry (all of it by default), copied into
        ``out`` (a ``uint8`` tensor of that length) or into a new tensor. None on a miss; then
        the content of ``out`` is unspecified."""

    def get_into(self, key: ChunkKey, out: torch.Tensor, late: Callable[[Future], None]) -> bool:
        """The whole entry into ``out``; whether it was read. A tier whose calls can be given up
        on a timeout (a remote tier) may read straight into ``out`` here, saving a copy; when it
        gives up on such a call it returns False and passes ``late`` a Future that completes
        once nothing writes ``out`` any more: until then the caller must not reuse ``out``.
        :meth:`get` never writes ``out`` after it returns. Default: ``get(key, out=out)``."""
        return self.get(key, out=out) is not None

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor],
                      late: Callable[[Future], None]) -> list[bool]:
        """:meth:`get_into` each key into its ``out``; whether each was read. ``late`` gets the
        Future of every call given up on (each ``out`` whose read returned False must then wait
        until all of them are done). Default: one ``get_into`` after the other."""
        self._paired(keys, outs, "outputs")
        return [self.get_into(key, out, late) for key, out in zip(keys, outs, strict=True)]

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool: ...

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys``, from the first, this tier holds (committed entries). A remote
        tier answers in one round trip; by default, one ``contains`` per key."""
        for n, key in enumerate(keys):
            if not self.contains(key):
                return n
        return len(keys)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether this tier holds each of ``keys``. A remote tier answers in one round trip
        (False for all when its server is down); by default, one ``contains`` per key."""
        return [self.contains(key) for key in keys]

    @abstractmethod
    def entry_bytes(self, key: ChunkKey) -> int | None:
        """Size of a committed entry, None if absent."""

    def format_of(self, key: ChunkKey) -> KVFormat | None:
        """What a committed entry's bytes are when the tier knows (see ``fmt`` of :meth:`put`);
        None otherwise. Answers from memory: no I/O (it is asked under the store's lock)."""
        return None

    @abstractmethod
    def keys(self) -> list[ChunkKey]:
        """Committed keys, oldest first. Reads the whole index (for a remote tier, all of it
        from the server): for listing and restarts, never per request; :meth:`oldest` for a
        few victims."""

    def oldest(self, n: int) -> list[ChunkKey]:
        """At most ``n`` committed keys, oldest first (the first ``n`` of :meth:`keys`). For
        making room a few entries at a time: a remote tier asks its server one bounded query
        (Valkey) or reads its own list (Mooncake), never the server's whole index. Default:
        ``keys()[:n]``, a copy of the in-memory index (local tiers)."""
        return self.keys()[:n] if self._check_limit(n) else []

    def _check_limit(self, n: object) -> int:
        """``n`` of :meth:`oldest`, checked (ValueError unless an int >= 0)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{self.name}: oldest(n) needs an int n >= 0, got {n!r}")
        return n

    # -- deletes ------------------------------------------------------------------------------
    def delete(self, key: ChunkKey) -> bool:
        """Remove a committed entry. False if absent; EntryPinnedError if pinned."""
        with self._lock:
            if self._pins.get(key):
                raise EntryPinnedError(f"{self.name}: chunk {key.hex()} is pinned by a reader")
            removed = self._delete_unpinned(key)
            if removed:
                self.stats.deletes += 1
            return removed

    @abstractmethod
    def _delete_unpinned(self, key: ChunkKey) -> bool: ...

    # -- pins ---------------------------------------------------------------------------------
    def pin(self, key: ChunkKey) -> bool:
        """Pin a committed entry against deletion. False (and no pin) if absent."""
        with self._lock:
            if not self.contains(key):
                return False
            self._pins[key] = self._pins.get(key, 0) + 1
            return True

    def pin_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """``pin`` each of ``keys``. A remote tier asks its server once (``contains_many``)."""
        return [self.pin(key) for key in keys]

    def unpin(self, key: ChunkKey) -> None:
        with self._lock:
            count = self._pins.get(key, 0)
            if count <= 0:
                raise ValueError(f"{self.name}: unpin of chunk {key.hex()} that is not pinned")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._lock:
            return bool(self._pins.get(key))

    def pinned_count(self) -> int:
        """Entries pinned now (by this process)."""
        with self._lock:
            return len(self._pins)

    def pin_total(self) -> int:
        """Pins held now (by this process), nested ones each counted: :meth:`pinned_count`
        counts distinct entries, this counts every ``pin`` not yet matched by an ``unpin`` (a
        gap between the two that grows is a leaked pin)."""
        with self._lock:
            return sum(self._pins.values())

    def reserved_count(self) -> int:
        """Reservations open now (entries being written), where the tier tracks them."""
        with self._lock:
            return len(getattr(self, "_reserved", ()))

    @contextlib.contextmanager
    def pinned(self, key: ChunkKey) -> Iterator[bool]:
        """``with tier.pinned(key) as held:`` -- held is False if the entry is absent."""
        held = self.pin(key)
        try:
            yield held
        finally:
            if held:
                self.unpin(key)

    def close(self) -> None:
        """Release resources. Committed entries of persistent tiers stay."""

    def __len__(self) -> int:
        return len(self.keys())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
