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
- :mod:`kvtier.store.config` -- the store's configuration and result types.
"""

from kvtier.store.config import RemoteConfig, StoreConfig
from kvtier.store.facade import KVStore
from kvtier.store.results import LoadResult, LookupResult, SaveResult, StoreStats

__all__ = ["KVStore", "LoadResult", "LookupResult", "RemoteConfig", "SaveResult", "StoreConfig", "StoreStats"]
