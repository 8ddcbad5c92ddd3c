"""Bookkeeping without I/O: chunk keys, KV layout, the chunk index and placement policies.

Nothing in this package imports torch or touches a file; tiers and the store build on it.
"""

from kvtier.core.keys import ChunkKey, Namespace, TokenChunks, chunk_tokens_of, to_token_array
from kvtier.core.layout import KVLayout

__all__ = ["ChunkKey", "KVLayout", "Namespace", "TokenChunks", "chunk_tokens_of", "to_token_array"]
