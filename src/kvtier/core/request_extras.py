"""What besides token ids is chained into a request's chunk keys, as bytes.

vLLM's own block hashes take a request's ``cache_salt``, its LoRA adapter and its images into
account; kvtier chains the same inputs into its keys (:func:`kvtier.core.keys.chunk_tokens_of`
``extras``), so a salted request never shares KV with an unsalted one. Everyone who names
those keys -- the vLLM connector's scheduler, the daemon's HTTP lookup -- must build the bytes
alike, so they are built here and only here.

    head = request_head(salt="user-42")              # into the first chunk's key (so every key)
    keys = chunk_tokens_of(tokens, ns, 256, {0: head} if head else None).keys

Each field is tagged and length-prefixed, so no two sets of fields read alike.
"""

from __future__ import annotations

__all__ = ["request_head", "tagged"]


def tagged(tag: bytes, value: object) -> bytes:
    """``tag``, the length of ``str(value)`` in UTF-8 (4 bytes, little-endian), then those bytes."""
    raw = str(value).encode()
    return tag + len(raw).to_bytes(4, "little") + raw


def request_head(*, salt: str | None = None, epoch: bytes | None = None,
                 lora: tuple[str, str] | None = None) -> bytes:
    """The extra bytes of a request's first chunk (empty: none, keys as without extras).

    ``salt``: its ``cache_salt`` (empty or None: unsalted). ``epoch``: the cache epoch the
    vLLM scheduler chains after a ``reset_cache`` (None before any). ``lora``: the adapter's
    (name, path)."""
    head = tagged(b"salt", salt) if salt else b""
    if epoch is not None:
        head += tagged(b"epoch", epoch.hex())
    if lora is not None:
        head += tagged(b"lora", lora[0]) + tagged(b"path", lora[1])
    return head
