"""The store: one model's KV over a hierarchy of tiers (host DRAM, SSD, a shared remote tier).

The facade is :class:`KVStore` (:mod:`kvtier.store.facade`), configured by :class:`StoreConfig`.
Below it, each module one part of the store's engine:

- :mod:`kvtier.store.cache` -- :class:`~kvtier.store.cache.ChunkCache`: the tiers, the index and
  the placement policy under one lock (bookkeeping only; bytes move outside it); its lookups,
  reads, writes and counters are in :mod:`~kvtier.store.cache_lookups`,
  :mod:`~kvtier.store.cache_reads`, :mod:`~kvtier.store.cache_writes` and
  :mod:`~kvtier.store.cache_counters`.
- :mod:`kvtier.store.moves` -- the live mover; its reads up into DRAM are in
  :mod:`kvtier.store.promotions`.
- :mod:`kvtier.store.transfers` -- transfer handlers per pair of tiers.
- :mod:`kvtier.store.uploader` -- background uploads into the remote tier.
- :mod:`kvtier.store.remote_level` -- what the shared remote tier is known to hold.
- :mod:`kvtier.store.request_numbers` -- request numbers: the policies' notion of a use.
- :mod:`kvtier.store.packing` -- copying KV between an engine's tensors and a chunk's bytes.
- :mod:`kvtier.store.config` -- the store's configuration.
- :mod:`kvtier.store.results` -- what its calls return, its counters, and what an engine needs
  of a KV cache.

The names below are imported when first asked for: a daemon's client importing
:mod:`kvtier.store.results` does not import the store's tiers with it.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.store.config import RemoteConfig, StoreConfig
    from kvtier.store.facade import KVStore
    from kvtier.store.results import LoadResult, LookupResult, SaveResult, StoreStats

_HOME = {
    "KVStore": "kvtier.store.facade",
    "LoadResult": "kvtier.store.results",
    "LookupResult": "kvtier.store.results",
    "RemoteConfig": "kvtier.store.config",
    "SaveResult": "kvtier.store.results",
    "StoreConfig": "kvtier.store.config",
    "StoreStats": "kvtier.store.results",
}

__all__ = ["KVStore", "LoadResult", "LookupResult", "RemoteConfig", "SaveResult", "StoreConfig", "StoreStats"]


def __getattr__(name: str) -> object:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'kvtier.store' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *_HOME]
