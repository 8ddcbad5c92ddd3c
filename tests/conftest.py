import logging

import pytest
import torch

from kvtier.core.layout import KVLayout
from tests.remote_servers import (  # noqa: F401 - real-server fixtures, found by pytest here
    mooncake_private,
    mooncake_shared,
    valkey_cluster,
    valkey_private,
    valkey_standalone,
)


@pytest.fixture
def layout() -> KVLayout:
    # 4 layers x (K, V) x 2 heads x 16 tokens x 32 dims x 4 bytes = 4 KiB a layer, 16 KiB a chunk.
    return KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=16)


def make_kv(layout: KVLayout, tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic per-layer (K, V), each [heads, tokens, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(layout.num_layers)
    ]


@pytest.fixture(autouse=True)
def _kvtier_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The embedded ``tiny`` default model, built once per session in a private KVTIER home
    (never the user's ~/.cache)."""
    from kvtier.engines.default_model import default_model_dir

    return default_model_dir("tiny", home=tmp_path_factory.mktemp("kvtier-home"))
