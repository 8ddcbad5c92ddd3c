"""kvtier: a tiered KV-cache store (HBM -> host DRAM -> SSD -> remote) for LLM inference.

Three names get you started::

    from kvtier import KVLayout, KVStore, StoreConfig
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.core.layout import KVLayout
    from kvtier.store import KVStore, LoadResult, LookupResult, SaveResult, StoreConfig
    from kvtier.tiers.disk_config import DiskTierConfig
    from kvtier.tiers.host_config import HostTierConfig

_HOME = {
    "DiskTierConfig": "kvtier.tiers.disk_config",
    "HostTierConfig": "kvtier.tiers.host_config",
    "KVLayout": "kvtier.core.layout",
    "KVStore": "kvtier.store",
    "LoadResult": "kvtier.store.results",
    "LookupResult": "kvtier.store.results",
    "SaveResult": "kvtier.store.results",
    "StoreConfig": "kvtier.store.config",
}
"""Where each of the root's names lives. Imported when first asked for, so that importing one
part of kvtier (``kvtier.core.keys``, a daemon's client) does not import the store, its tiers
and torch with it."""

__all__ = ["DiskTierConfig", "HostTierConfig", "KVLayout", "KVStore", "LoadResult", "LookupResult", "SaveResult",
           "StoreConfig"]


def __getattr__(name: str) -> object:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *_HOME]


__version__ = "0.1.0"
