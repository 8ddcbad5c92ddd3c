"""One remote tier per tenant, each under a key prefix of its own, behind one Tier.

With ``ValkeyTierConfig(tenant_prefixes=True)`` a store keeps each tenant's chunks (and that
tenant's index, budget and reservations) under ``<prefix>.t.<tenant>`` -- ``<prefix>.shared``
for the empty tenant -- so that Valkey ACLs can confine an instance to its tenants' keys
(``~{<prefix>.t.acme}* ~{<prefix>.t.acme:*``). Each tenant's prefix has the whole
``capacity_bytes`` budget.

Which tenant a key belongs to: writes name it (``put_many(..., tenants=)``, or the tier of one
tenant, :meth:`TenantTiers.for_tenant`, which the store's uploader uses) -- the store takes it
from the entry itself, which records its tenant in DRAM and in its SSD file's header, and whose
remote object lies under its tenant's prefix, so an eviction or an upload after a restart never
depends on a map held in memory. Reads and lookups ask ``tenant_of(key)``, which the store
answers with the tenant of the request being served (its keys are bound to that tenant), else
the tenant recorded with the entry (DRAM, SSD, or the tenant a probe found it under; a
background read of a remote-only chunk no request named since a restart asks the shared
prefix: a miss, never another tenant's bytes, since keys are bound to their tenant).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
import xxhash

from kvtier.core.keys import ChunkKey
from kvtier.tiers.base import PutOutcome, Reservation, Tier, TierStats
from kvtier.tiers.codec_types import KVFormat

_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def tenant_prefix(prefix: str, tenant: str) -> str:
    """The key prefix of ``tenant``'s chunks: its name when it is a plain word, else a hash."""
    if not tenant:
        return f"{prefix}.shared"
    tag = tenant if _SAFE.fullmatch(tenant) else "h" + xxhash.xxh64_hexdigest(tenant.encode())
    return f"{prefix}.t.{tag}"


class TenantTiers(Tier):
    """Routes every call to the tier of its key's tenant (made on first use)."""

    def __init__(self, make: Callable[[str], Tier], tenant_of: Callable[[ChunkKey], str]) -> None:
        super().__init__()
        self._make = make
        self._tenant_of = tenant_of
        self._tiers: dict[str, Tier] = {}
        self._made = threading.Lock()
        self.shared = self._tier("")
        self.name = self.shared.name

    @property  # type: ignore[override]
    def stats(self) -> TierStats:
        """Every tenant's tier's counters, summed."""
        total = TierStats()
        for tier in list(getattr(self, "_tiers", {}).values()):
            for field, value in tier.stats.as_dict().items():
                setattr(total, field, getattr(total, field) + value)
        return total

    @stats.setter
    def stats(self, value: TierStats) -> None:  # Tier.__init__ sets one; the sum replaces it
        pass

    def _tier(self, tenant: str) -> Tier:
        tier = self._tiers.get(tenant)
        if tier is None:
            with self._made:
                tier = self._tiers.get(tenant)
                if tier is None:
                    tier = self._tiers[tenant] = self._make(tenant)
        return tier

    def for_tenant(self, tenant: str) -> Tier:
        """The tier of ``tenant``'s chunks (its own prefix)."""
        return self._tier(tenant)

    def _for(self, key: ChunkKey) -> Tier:
        return self._tier(self._tenant_of(key))

    def _groups(self, keys: Sequence[ChunkKey]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._tenant_of(key), []).append(i)
        return groups

    # -- size ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.shared.capacity

    @property
    def used(self) -> int:
        return sum(t.used for t in list(self._tiers.values()))

    def footprint(self, nbytes: int, segment_bytes: int | None = None) -> int:
        return self.shared.footprint(nbytes, segment_bytes)

    # -- one key ------------------------------------------------------------------------------
    def reserve(self, key: ChunkKey, nbytes: int, segment_bytes: int | None = None) -> Reservation:
        return self._for(key).reserve(key, nbytes, segment_bytes)

    def commit(self, reservation: Reservation, ok: bool = True) -> bool:
        return self._for(reservation.key).commit(reservation, ok)

    def put(self, key: ChunkKey, data: object, segment_bytes: int | None = None, *,
            fmt: KVFormat | None = None) -> bool:
        return self._for(key).put(key, data, segment_bytes, fmt=fmt)

    def get(self, key: ChunkKey, out: torch.Tensor | None = None, offset: int = 0,
            length: int | None = None) -> torch.Tensor | None:
        return self._for(key).get(key, out, offset, length)

    def get_into(self, key: ChunkKey, out: torch.Tensor, late: Callable[[Future], None]) -> bool:
        return self._for(key).get_into(key, out, late)

    def contains(self, key: ChunkKey) -> bool:
        return self._for(key).contains(key)

    def entry_bytes(self, key: ChunkKey) -> int | None:
        return self._for(key).entry_bytes(key)

    def delete(self, key: ChunkKey) -> bool:
        return self._for(key).delete(key)

    def _delete_unpinned(self, key: ChunkKey) -> bool:  # pragma: no cover - delete is routed
        return self._for(key).delete(key)

    def pin(self, key: ChunkKey) -> bool:
        return self._for(key).pin(key)

    def unpin(self, key: ChunkKey) -> None:
        self._for(key).unpin(key)

    def is_pinned(self, key: ChunkKey) -> bool:
        return self._for(key).is_pinned(key)

    # -- batches, one call per tenant ---------------------------------------------------------
    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[object],
                 segment_bytes: int | None = None, *,
                 fmts: Sequence[KVFormat | None] | None = None,
                 tenants: Sequence[str] | None = None) -> list[PutOutcome]:
        """``tenants``: each entry's tenant (default: ``tenant_of`` each key)."""
        self._paired(keys, datas, "entries")
        if fmts is not None:
            self._paired(keys, fmts, "formats")
        out: list[PutOutcome] = [False] * len(keys)
        if tenants is not None:
            self._paired(keys, tenants, "tenants")
            groups: dict[str, list[int]] = {}
            for i, tenant in enumerate(tenants):
                groups.setdefault(tenant, []).append(i)
        else:
            groups = self._groups(keys)
        for tenant, idx in groups.items():
            got = self._tier(tenant).put_many([keys[i] for i in idx], [datas[i] for i in idx], segment_bytes,
                                              fmts=None if fmts is None else [fmts[i] for i in idx])
            for i, r in zip(idx, got, strict=True):
                out[i] = r
        return out

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor],
                      late: Callable[[Future], None]) -> list[bool]:
        result = [False] * len(keys)
        for tenant, idx in self._groups(keys).items():
            got = self._tier(tenant).get_many_into([keys[i] for i in idx], [outs[i] for i in idx], late)
            for i, r in zip(idx, got, strict=True):
                result[i] = r
        return result

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        result = [False] * len(keys)
        for tenant, idx in self._groups(keys).items():
            got = self._tier(tenant).contains_many([keys[i] for i in idx])
            for i, r in zip(idx, got, strict=True):
                result[i] = r
        return result

    def pin_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        result = [False] * len(keys)
        for tenant, idx in self._groups(keys).items():
            got = self._tier(tenant).pin_many([keys[i] for i in idx])
            for i, r in zip(idx, got, strict=True):
                result[i] = r
        return result

    def contains_prefix(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        return self._for(keys[0]).contains_prefix(keys)  # a lookup's keys share one namespace

    def keys(self) -> list[ChunkKey]:
        return [k for tier in list(self._tiers.values()) for k in tier.keys()]

    def oldest(self, n: int) -> list[ChunkKey]:
        """Each tenant's tier's oldest (one bounded query each) until ``n``, shared prefix first.
        A tenant's budget is its own: room for its chunk is made with ``for_tenant(t).oldest``."""
        out: list[ChunkKey] = []
        for tier in list(self._tiers.values()):
            if len(out) >= self._check_limit(n):
                break
            out += tier.oldest(n - len(out))
        return out

    def pinned_count(self) -> int:
        return sum(t.pinned_count() for t in list(self._tiers.values()))  # pins live in each tenant's tier

    def pin_total(self) -> int:
        return sum(t.pin_total() for t in list(self._tiers.values()))

    def close(self) -> None:
        for tier in list(self._tiers.values()):
            tier.close()
