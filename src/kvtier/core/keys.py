"""Content-addressed chunk keys.

A token sequence is cut into fixed chunks of ``chunk_tokens`` tokens; only full chunks get keys
(the tail shorter than a chunk is always recomputed). The key of chunk ``i`` is a 128-bit
XXH3 hash chained over ``(key of chunk i-1, namespace digest, token ids of chunk i)``, so a key
names the whole prefix up to and including its chunk, and two sequences share chunk ``i`` only if
they share every token before it and the namespace.

The namespace holds what makes KV bytes differ for the same tokens: the model fingerprint, the
KV layout fingerprint and an optional tenant salt. Token ids are hashed as little-endian int64,
so keys are identical across processes and machines (never Python's ``hash()``, which is salted
per process).

A store keys a chunk by :func:`bind_keys` of its chain key and the namespace the store checked
the request under: the store daemon cannot check that a client hashed its tokens under the
namespace it claims, so it binds every key the client sends to the namespace (tenant included)
the client is allowed; a client can then only ever reach the chunks of its own namespaces.
Stores chain keys under the model and layout alone and bind the tenant, and the in-process
store does as the daemon does, so both name a chunk alike (in a shared remote tier too).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NewType

import numpy as np
import xxhash

ChunkKey = NewType("ChunkKey", bytes)
"""16 raw bytes; use ``key.hex()`` for display and file names."""

KEY_BYTES = 16
ROOT_KEY = ChunkKey(bytes(KEY_BYTES))
"""The parent of the first chunk of every sequence."""

_TOKEN_DTYPE = np.dtype("<i8")


MAX_TENANT_BYTES = 512
"""A tenant name's UTF-8 length at most (it is stored with each of its chunks)."""


@dataclass(frozen=True)
class Namespace:
    """What, besides the tokens, determines a chunk's KV bytes.

    ``model`` is a fingerprint of the weights (a name and revision at least), ``layout`` the
    :attr:`KVLayout.fingerprint`, ``tenant`` a salt that keeps tenants apart (empty: shared).
    """

    model: str
    layout: str
    tenant: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "layout", "tenant"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Namespace.{name} must be a str, got {type(getattr(self, name))}")
        if not self.model:
            raise ValueError("Namespace.model must not be empty")
        if not self.layout:
            raise ValueError("Namespace.layout must not be empty")
        if len(self.tenant.encode()) > MAX_TENANT_BYTES:  # SSD headers and remote prefixes carry it
            raise ValueError(f"a tenant name is at most {MAX_TENANT_BYTES} bytes of UTF-8, "
                             f"got {len(self.tenant.encode())}")
        # Length-prefixed fields: ("ab", "c") and ("a", "bc") must not collide.
        h = xxhash.xxh3_128(b"kvtier-ns-v1")
        for part in (self.model, self.layout, self.tenant):
            raw = part.encode()
            h.update(len(raw).to_bytes(4, "little"))
            h.update(raw)
        object.__setattr__(self, "digest", h.digest())

    def with_tenant(self, tenant: str) -> Namespace:
        return Namespace(self.model, self.layout, tenant)


def to_token_array(tokens: object) -> np.ndarray:
    """Return ``tokens`` as a 1-D little-endian int64 array, or raise naming the problem.

    Accepts a sequence of Python ints, a NumPy integer array or a torch integer tensor
    (anything with ``.numpy()``). Floats, bools, strings and negative ids are rejected.
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    elif hasattr(tokens, "numpy") and hasattr(tokens, "dtype"):
        if getattr(tokens, "is_floating_point", lambda: False)() or str(tokens.dtype) == "torch.bool":
            raise TypeError(f"tokens must be integers, got a tensor of {tokens.dtype}")
        arr = tokens.detach().cpu().numpy()  # type: ignore[attr-defined]
    elif isinstance(tokens, (str, bytes)):
        raise TypeError(f"tokens must be a sequence of integer ids, got {type(tokens).__name__}")
    elif isinstance(tokens, Sequence):
        try:
            # array('q') is the fastest exact conversion of a list of ints and refuses floats.
            arr = np.frombuffer(array.array("q", tokens), dtype=np.int64)
        except TypeError as exc:
            bad = next((t for t in tokens if not isinstance(t, (int, np.integer))), None)
            raise TypeError(
                f"tokens must be integers, found {bad!r} of type {type(bad).__name__}"
            ) from exc
        except OverflowError as exc:
            raise ValueError(f"token id out of int64 range: {exc}") from exc
        types = set(map(type, tokens))
        if bool in types or np.bool_ in types:  # array('q') takes them as 1 and 0
            bad = next(t for t in tokens if isinstance(t, (bool, np.bool_)))
            raise TypeError(f"tokens must be integers, found {bad!r} of type {type(bad).__name__}")
    else:
        raise TypeError(f"tokens must be a sequence of integer ids, got {type(tokens).__name__}")

    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"token ids must be non-negative, found {int(arr.min())}")
    if arr.dtype != _TOKEN_DTYPE:
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError("token id out of int64 range")
        arr = arr.astype(_TOKEN_DTYPE)
    return np.ascontiguousarray(arr)


@dataclass(frozen=True, slots=True)
class TokenChunks:
    """The full chunks of one token sequence and their chained keys."""

    keys: list[ChunkKey]
    chunk_tokens: int
    num_tokens: int

    @property
    def covered_tokens(self) -> int:
        """Tokens covered by full chunks (the tail is never cached)."""
        return len(self.keys) * self.chunk_tokens


def image_extras(spans: Sequence[tuple[int, int, str]], chunk_tokens: int) -> dict[int, bytes]:
    """Extras for :func:`chunk_tokens_of` from image placeholder spans ``(start, end, content
    hash)`` (token positions, end excluded): each chunk gets the hashes of the images that
    overlap it, in order."""
    extras: dict[int, bytes] = {}
    for start, end, digest in spans:
        if not 0 <= start < end:
            raise ValueError(f"an image span needs 0 <= start < end, got ({start}, {end})")
        for i in range(start // chunk_tokens, (end - 1) // chunk_tokens + 1):
            extras[i] = extras.get(i, b"") + digest.encode()
    return extras


def check_extras(extras: object) -> None:
    """``extras`` as :func:`chunk_tokens_of` takes them (a mapping of chunk index to bytes), or
    a TypeError naming what is wrong."""
    if not isinstance(extras, Mapping):
        raise TypeError(f"extras must be a mapping of chunk index to bytes (e.g. {{0: digest}}), "
                        f"got {type(extras).__name__}")
    for i, extra in extras.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise TypeError(f"extras: a key is a chunk index (an int >= 0), got {i!r}")
        if not isinstance(extra, (bytes, bytearray, memoryview)):
            raise TypeError(f"extras[{i}] must be bytes (a content hash), got {type(extra).__name__}")


def chunk_tokens_of(tokens: object, namespace: Namespace, chunk_tokens: int,
                    extras: Mapping[int, bytes] | None = None) -> TokenChunks:
    """Cut ``tokens`` into full chunks and compute their chained keys.

    ``extras[i]``: more bytes that determine chunk ``i``'s KV besides its token ids -- the
    content hashes of the images whose placeholder tokens lie in it (vLLM's and SGLang's extra
    keys). Chained, they change every later key too: the same text with another image never
    shares KV from that chunk on. Chunks without extras hash as they always have."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    arr = to_token_array(tokens)
    if extras is not None:
        check_extras(extras)
    if sys.byteorder != "little":  # pragma: no cover - keys must not depend on the host
        arr = arr.byteswap().view(arr.dtype.newbyteorder())
    raw = memoryview(arr).cast("B")
    step = chunk_tokens * _TOKEN_DTYPE.itemsize
    n_full = arr.size // chunk_tokens
    ns = namespace.digest
    parent = ROOT_KEY
    keys: list[ChunkKey] = []
    digest = xxhash.xxh3_128_digest
    extras = extras or {}
    for i in range(n_full):
        extra = extras.get(i)
        parts = (parent, ns, raw[i * step : (i + 1) * step])
        if extra:
            parts = (*parts, b"kvtier-extra", len(extra).to_bytes(4, "little"), extra)
        parent = ChunkKey(digest(b"".join(parts)))
        keys.append(parent)
    return TokenChunks(keys=keys, chunk_tokens=chunk_tokens, num_tokens=int(arr.size))


def tail_key(parent: ChunkKey, namespace: Namespace, tokens: object, extra: bytes | None = None) -> ChunkKey:
    """The key of a partial chunk: the first ``tokens`` of the chunk after ``parent`` (fewer than
    a chunk's), chained as a full chunk is but tagged with its length, so it never names a full
    chunk or a partial chunk of another length. Engines save the tail of a finished sequence
    this way (whole blocks of it), so the sequence's continuation finds all of it.
    ``extra``: as :func:`chunk_tokens_of`'s extras for this chunk (the first chunk's salt)."""
    arr = to_token_array(tokens)
    if sys.byteorder != "little":  # pragma: no cover
        arr = arr.byteswap().view(arr.dtype.newbyteorder())
    parts = [parent, namespace.digest, b"kvtier-tail", arr.size.to_bytes(4, "little"), memoryview(arr).cast("B")]
    if extra:
        parts += [b"kvtier-extra", len(extra).to_bytes(4, "little"), extra]
    return ChunkKey(xxhash.xxh3_128_digest(b"".join(parts)))


def bind_keys(namespace: Namespace, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
    """The store keys of chain keys ``keys`` under ``namespace``: 128-bit XXH3 of (a tag, the
    namespace digest, the chain key)."""
    head = b"kvtier-bind-v1" + namespace.digest
    digest = xxhash.xxh3_128_digest
    return [ChunkKey(digest(head + key)) for key in keys]
