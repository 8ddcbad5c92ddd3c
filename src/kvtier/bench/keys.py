"""Latency of a lookup's bookkeeping: chunking + hashing a long prompt, then the index lookup.

One measurement is ``chunk_tokens_of(tokens, namespace, chunk_tokens)`` followed by
``ChunkIndex.longest_prefix(keys)`` on an index that holds every key of the sequence (the worst
case: the whole prefix hits, so every key is looked up). It is taken for the tokens as a Python
``list`` of ints (what a tokenizer returns) and as a NumPy ``int64`` array. Reported: the median
(and best) of ``repeats`` measurements after one untimed warm-up, in milliseconds, next to the
target of :data:`TARGET_MS`. No tier, no I/O and no torch are involved.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from kvtier.core.index import ChunkIndex
from kvtier.core.keys import Namespace, chunk_tokens_of

TARGET_MS = 5.0
"""Budget for the bookkeeping of a 128K-token lookup (a small share of its prefill time)."""


@dataclass(frozen=True)
class KeysBenchConfig:
    num_tokens: int = 131072
    chunk_tokens: int = 256
    repeats: int = 50
    vocab: int = 128000
    """Token ids are drawn (with a fixed seed) from ``range(vocab)``."""

    def __post_init__(self) -> None:
        for name in ("num_tokens", "chunk_tokens", "repeats", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_tokens < self.chunk_tokens:
            raise ValueError(
                f"num_tokens ({self.num_tokens}) must hold at least one chunk of "
                f"{self.chunk_tokens} tokens"
            )


@dataclass(frozen=True, slots=True)
class LatencyResult:
    """Milliseconds per measurement of one input kind."""

    input: str
    median_ms: float
    best_ms: float
    chunk_median_ms: float
    """Of which chunking and hashing (``chunk_tokens_of``)."""
    lookup_median_ms: float
    """Of which ``longest_prefix``."""
    hit_chunks: int

    def as_dict(self, target_ms: float) -> dict[str, object]:
        return {
            "median_ms": self.median_ms,
            "best_ms": self.best_ms,
            "chunk_median_ms": self.chunk_median_ms,
            "lookup_median_ms": self.lookup_median_ms,
            "hit_chunks": self.hit_chunks,
            "meets_target": self.median_ms < target_ms,
        }


@dataclass(frozen=True, slots=True)
class KeysBenchResult:
    list_input: LatencyResult
    array_input: LatencyResult
    config: KeysBenchConfig
    target_ms: float = TARGET_MS

    @property
    def num_chunks(self) -> int:
        return self.config.num_tokens // self.config.chunk_tokens

    @property
    def meets_target(self) -> bool:
        return max(self.list_input.median_ms, self.array_input.median_ms) < self.target_ms

    def as_dict(self) -> dict[str, object]:
        return {
            "num_tokens": self.config.num_tokens,
            "chunk_tokens": self.config.chunk_tokens,
            "num_chunks": self.num_chunks,
            "repeats": self.config.repeats,
            "target_ms": self.target_ms,
            "meets_target": self.meets_target,
            "list": self.list_input.as_dict(self.target_ms),
            "numpy": self.array_input.as_dict(self.target_ms),
        }


def _measure(name: str, tokens: object, namespace: Namespace, index: ChunkIndex,
             config: KeysBenchConfig) -> LatencyResult:
    totals: list[float] = []
    chunking: list[float] = []
    lookups: list[float] = []
    hit = 0
    for rep in range(config.repeats + 1):  # rep 0 is the warm-up
        t0 = time.perf_counter()
        chunks = chunk_tokens_of(tokens, namespace, config.chunk_tokens)
        t1 = time.perf_counter()
        hit = len(index.longest_prefix(chunks.keys))
        t2 = time.perf_counter()
        if rep:
            totals.append((t2 - t0) * 1e3)
            chunking.append((t1 - t0) * 1e3)
            lookups.append((t2 - t1) * 1e3)
    return LatencyResult(name, statistics.median(totals), min(totals),
                         statistics.median(chunking), statistics.median(lookups), hit)


def run_keys_bench(config: KeysBenchConfig | None = None) -> KeysBenchResult:
    """Measure both input kinds. Raises RuntimeError if the lookup does not hit every chunk
    (the benchmark would then time a shorter walk than it claims)."""
    config = config or KeysBenchConfig()
    rng = np.random.default_rng(0)
    array = rng.integers(0, config.vocab, config.num_tokens, dtype=np.int64)
    tokens = array.tolist()
    namespace = Namespace(model="kvtier-bench-model", layout="kvtier-bench-layout")
    index = ChunkIndex()
    for key in chunk_tokens_of(array, namespace, config.chunk_tokens).keys:
        index.add(key, 0)
    results = [_measure(name, data, namespace, index, config)
               for name, data in (("list", tokens), ("numpy", array))]
    expected = config.num_tokens // config.chunk_tokens
    for r in results:
        if r.hit_chunks != expected:
            raise RuntimeError(f"{r.input}: lookup hit {r.hit_chunks} of {expected} chunks")
    return KeysBenchResult(results[0], results[1], config)
