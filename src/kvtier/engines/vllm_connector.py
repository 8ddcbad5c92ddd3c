"""The connector's first module path, kept so existing ``--kv-transfer-config`` JSON keeps
working; new configurations name ``kvtier.engines.vllm``."""

from kvtier.engines.vllm import KVTierConnector

__all__ = ["KVTierConnector"]
