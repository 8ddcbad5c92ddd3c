"""kvtier as vLLM's KV connector: ``kv_connector_module_path = "kvtier.engines.vllm"``."""

from kvtier.engines.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
