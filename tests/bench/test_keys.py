"""The key bookkeeping benchmark, run small: structure, never speed."""

from __future__ import annotations

import math

import pytest

from kvtier.bench.keys import TARGET_MS, KeysBenchConfig, run_keys_bench


def test_small_run_hits_every_chunk_for_both_inputs():
    result = run_keys_bench(KeysBenchConfig(num_tokens=4096 + 100, chunk_tokens=256, repeats=3))
    data = result.as_dict()
    assert data["num_chunks"] == 16
    assert data["target_ms"] == TARGET_MS == 5.0
    assert isinstance(data["meets_target"], bool)
    for kind in ("list", "numpy"):
        fig = data[kind]
        assert fig["hit_chunks"] == 16
        for name in ("median_ms", "best_ms", "chunk_median_ms", "lookup_median_ms"):
            assert math.isfinite(fig[name]) and fig[name] > 0
        assert fig["best_ms"] <= fig["median_ms"]
        assert fig["meets_target"] == (fig["median_ms"] < TARGET_MS)


def test_default_is_a_128k_prompt_in_chunks_of_256():
    config = KeysBenchConfig()
    assert (config.num_tokens, config.chunk_tokens) == (131072, 256)


@pytest.mark.parametrize(
    "kw",
    [
        {"num_tokens": 0},
        {"chunk_tokens": -1},
        {"repeats": 0},
        {"num_tokens": 100, "chunk_tokens": 256},
    ],
)
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        KeysBenchConfig(**kw)
