"""Vector indexes (a user's long-term memory, a document corpus) kept in the store's tiers.

    indexes = VectorIndexes(store)
    opened = indexes.open("user-42-memory", version="7", build=lambda: make_faiss_index(...))
    distances, ids = opened.index.search(queries, k)

``open`` serves an index from DRAM when its bytes are resident there, reads it from SSD or the
remote tier otherwise (it is promoted into DRAM), and only on a full miss calls ``build``; the
built index is then stored, with the time the build took as the object's recompute cost, so the
``cost`` policy weighs it against KV and encoder outputs in the same budget. What is stored is
the index's own serialization (FAISS ``serialize_index`` by default), so a reopened index
answers every query exactly as the index that was built.

An index is keyed by name and version (and tenant): a new version is a new object; old versions
age out like anything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from kvtier.core.objects import ObjectKind, object_key
from kvtier.typed import TypedObjects

IndexT = TypeVar("IndexT")


@dataclass(frozen=True, slots=True)
class OpenedIndex(Generic[IndexT]):
    index: IndexT
    source: str
    """``built`` on a full miss, else the tier its bytes came from (``host``, ``disk``, ...)."""
    seconds: float
    """Time ``open`` took (build, or read and deserialize)."""


def _faiss_serialize(index: object) -> np.ndarray:
    import faiss

    return faiss.serialize_index(index)


def _faiss_deserialize(data: np.ndarray) -> object:
    import faiss

    return faiss.deserialize_index(data)


class VectorIndexes(Generic[IndexT]):
    """Open vector indexes by key through a store's tiers (see the module docstring)."""

    def __init__(self, objects: TypedObjects,
                 serialize: Callable[[IndexT], np.ndarray] = _faiss_serialize,  # type: ignore[assignment]
                 deserialize: Callable[[np.ndarray], IndexT] = _faiss_deserialize) -> None:  # type: ignore[assignment]
        self.objects = objects
        self._serialize = serialize
        self._deserialize = deserialize

    def key(self, name: str, version: str, tenant: str = "") -> bytes:
        return object_key(ObjectKind.INDEX_SHARD, name, version, tenant=tenant)

    def open(self, name: str, version: str, build: Callable[[], IndexT], *,
             tenant: str = "", rebuild_s: float | None = None) -> OpenedIndex[IndexT]:
        """The index ``name`` at ``version``. ``rebuild_s``: the declared cost of a rebuild
        (default: the measured time of ``build``)."""
        key = self.key(name, version, tenant)
        t0 = time.perf_counter()
        hit = self.objects.get(key)  # type: ignore[arg-type]
        if hit is not None:
            index = self._deserialize(hit.data.numpy())
            return OpenedIndex(index, hit.tier, time.perf_counter() - t0)
        index = build()
        built_s = time.perf_counter() - t0
        data = np.ascontiguousarray(self._serialize(index)).view(np.uint8)
        self.objects.put(key, data, ObjectKind.INDEX_SHARD,  # type: ignore[arg-type]
                         recompute_s=built_s if rebuild_s is None else rebuild_s)
        return OpenedIndex(index, "built", time.perf_counter() - t0)
