"""The daemon's per-request load log: where each request's chunks came from when their read
lease was granted, and how long the engine's step waited, as one rank reports them."""

from __future__ import annotations

import pytest

from kvtier.server.client import StoreClient
from kvtier.server.daemon import DaemonConfig, StoreDaemon
from kvtier.store.cache import CacheConfig
from kvtier.tiers.host_config import HostTierConfig

from .test_daemon import LAYOUT, MODEL, make_kv

C = LAYOUT.chunk_tokens


@pytest.fixture
def daemon(tmp_path):
    d = StoreDaemon(DaemonConfig(str(tmp_path / "kv.sock"), CacheConfig(
        HostTierConfig(8 * LAYOUT.chunk_bytes, extent_bytes=LAYOUT.chunk_bytes)))).start()
    yield d
    d.stop()


def test_every_request_is_logged_by_the_tier_it_loaded_from_and_its_wait(daemon):
    client = StoreClient(daemon.config.socket_path, model=MODEL, layout=LAYOUT)
    try:
        tokens = list(range(2 * C))
        assert client.save(tokens, make_kv(LAYOUT, 2 * C, seed=3)).stored == 2
        keys = client.keys_for(tokens)
        for i in range(100):  # more requests than the protocol's maps may hold entries
            lease = client.acquire(keys, request=f"kvtb-{i}-1-0000abcd")
            assert lease is not None
            client.release(lease, took=[C, C // 2], had=C // 2, wait_s=0.25)
        lease = client.acquire(keys, request="kvtb-100-1-0000abcd")
        client.release(lease, took=[C, C])  # another rank of the engine: not logged
        found = client.request_loads("kvtb-", limit=4096)
        assert len(found) == 100 and not any("kvtb-100-" in r for r in found)
        rec = next(v for k, v in found.items() if k.endswith("/kvtb-7-1-0000abcd"))
        assert rec["tokens"] == {"host": C + C // 2} and rec["had"] == C // 2 and rec["wait_s"] == 0.25
        assert rec["leases"] == 1 and rec["failed"] == 0
        assert list(client.request_loads("kvtb-7-")) == [k for k in found if "kvtb-7-" in k]
    finally:
        client.close()
