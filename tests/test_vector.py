"""A user's memory index, told as a story: built once, served from DRAM, pushed to SSD by other
traffic, reopened from SSD answering every query exactly as the index that was built."""

import faiss
import numpy as np

from kvtier.typed import TypedObjects
from kvtier.vector import VectorIndexes

from .conftest import make_kv
from .store.test_facade import C, store_of


def make_index(seed: int = 0) -> faiss.Index:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((3000, 32)).astype("float32")
    quantizer = faiss.IndexFlatL2(32)
    index = faiss.IndexIVFFlat(quantizer, 32, 16)
    index.train(vectors)
    index.add(vectors)
    index.nprobe = 4
    return index


def test_an_index_evicted_to_ssd_and_reopened_answers_identically(layout, tmp_path):
    queries = np.random.default_rng(9).standard_normal((50, 32)).astype("float32")
    builds = []

    def build():
        builds.append(1)
        return make_index()

    with store_of(layout, host_chunks=24, disk_path=tmp_path, disk_chunks=64) as store:
        indexes = VectorIndexes(TypedObjects(store))
        first = indexes.open("user-42", "v1", build)
        assert first.source == "built" and len(builds) == 1
        want = first.index.search(queries, 10)
        again = indexes.open("user-42", "v1", build)
        assert again.source == "host" and len(builds) == 1
        # other traffic fills DRAM: the index's parts go down to SSD
        store.save(list(range(24 * C)), make_kv(layout, 24 * C))
        reopened = indexes.open("user-42", "v1", build)
        assert reopened.source == "disk" and len(builds) == 1
        got = reopened.index.search(queries, 10)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        # a new version is another object: built again
        assert indexes.open("user-42", "v2", build).source == "built" and len(builds) == 2
