"""kvtier: a tiered KV-cache store (HBM -> host DRAM -> SSD -> remote) for LLM inference.

Three names get you started::

    from kvtier import KVLayout, KVStore, StoreConfig
"""

from kvtier.core.layout import KVLayout
from kvtier.store import KVStore, LoadResult, LookupResult, SaveResult, StoreConfig
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.host_config import HostTierConfig

__all__ = [
    "DiskTierConfig",
    "HostTierConfig",
    "KVLayout",
    "KVStore",
    "LoadResult",
    "LookupResult",
    "SaveResult",
    "StoreConfig",
]
__version__ = "0.1.0"
