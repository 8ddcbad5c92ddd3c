"""The vLLM connector's bookkeeping driven step by step with fake scheduler outputs and a fake
daemon client (a fake only to inject the faults: a load the daemon cannot complete). The vLLM
behaviour imitated is vLLM 0.32's scheduler: invalid blocks reschedule every request that uses
them, a resumed request's new block list replaces its old one. No chunk computed over KV that
never arrived, or read from blocks a request no longer owns, may be stored."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.core.layout import KVLayout
from kvtier.engines.vllm.connector import ChunkTransfer, KVTierConnector, KVTierMetadata

BLOCK = 4
CHUNK = 8  # 2 blocks a chunk
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", chunk_tokens=CHUNK)


class FakeLease:
    def __init__(self, keys, views):
        self.keys, self.views, self.tiers = keys, views, ["host"] * len(keys)
        self.held = [False] * len(keys)


class FakeClient:
    """Acquire gives only ``give`` chunks of a load; reserve gives a view per key."""

    def __init__(self, give: dict[str, int]):
        self.give = give
        self.committed: list[tuple[str, list]] = []
        self.abandoned: list = []

    def keys_for(self, prompt):
        return [bytes([i]) * 16 for i in range(len(prompt) // CHUNK)]

    def started(self, rid):
        pass

    def acquire(self, keys, first=0, request=None):
        n = self.give.get(request, len(keys))
        if n == 0:
            return None
        return FakeLease(keys[:n], [torch.zeros(LAYOUT.chunk_bytes, dtype=torch.uint8) for _ in range(n)])

    def release(self, lease, **kw):
        return True

    def reserve(self, keys, first=0, request=None):
        lease = FakeLease(keys, [torch.zeros(LAYOUT.chunk_bytes, dtype=torch.uint8) for _ in keys])
        lease.request = request
        return lease

    def commit(self, lease):
        self.committed.append((lease.request, list(lease.keys)))

    def abandon(self, lease):
        self.abandoned.append(lease.request)


def make_connector(client) -> KVTierConnector:
    c = object.__new__(KVTierConnector)
    c.client = client
    c.layout = LAYOUT
    c.block_size = BLOCK
    c._lookups, c._requests, c._loads, c._skip = {}, {}, [], set()
    c._hints = SimpleNamespace(submit=lambda *a, **k: None)
    c._hint_client = client
    num_blocks = 64
    # CPU-backend layout: [blocks, heads, block, 2*head_dim]
    c._kv = [torch.zeros(num_blocks, 1, BLOCK, 2 * 2)]
    c._kv_cache_config = SimpleNamespace(num_blocks=num_blocks)
    c._layer_of = {"l0": 0}
    c._block_dim = 0
    c._load_events, c._load_thread, c._leases = [], None, []
    c._copy_failed, c._failed_blocks, c._bad_reqs, c._pending_saves = False, set(), set(), []
    c._poisoned = {}
    c._connector_metadata = None
    return c


def run_step(c: KVTierConnector, meta: KVTierMetadata) -> set[int]:
    c._connector_metadata = meta
    c.start_load_kv(None)
    c.wait_for_layer_load("l0")
    c.save_kv_layer("l0", c._kv[0], None)
    c.wait_for_save()
    return c.get_block_ids_with_load_errors()


def test_a_request_sharing_a_failed_block_saves_nothing_it_computed_over_it():
    client = FakeClient(give={"A": 1})  # the daemon gives chunk 0 of A's 2 chunks
    c = make_connector(client)
    shared = [0, 1, 2, 3]  # blocks of chunks 0-1: A loads them, B shares them (vLLM's prefix cache)
    load_a = ChunkTransfer("A", client.keys_for(range(16)), 0, shared, 0)
    save_b = ChunkTransfer("B", [b"\x02" * 16], 2, shared + [4, 5])  # B's own chunk 2
    failed = run_step(c, KVTierMetadata(loads=[load_a], saves=[save_b]))
    assert failed == {2, 3}  # vLLM reschedules A and B
    assert client.committed == []  # B's chunk 2 attended to blocks 2-3: not stored


def test_a_resumed_request_saves_from_its_new_blocks():
    client = FakeClient(give={})
    c = make_connector(client)
    prompt = list(range(4 * CHUNK))
    new = SimpleNamespace(req_id="R", prompt_token_ids=prompt, block_ids=([10, 11, 12, 13],),
                          num_computed_tokens=0)
    empty_cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                   num_computed_tokens=[])
    so = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=empty_cached,
                         num_scheduled_tokens={"R": 2 * CHUNK}, finished_req_ids=set())
    assert c.build_connector_meta(so).saves[0].block_ids == [10, 11, 12, 13]
    # preempted (blocks 10.. freed, given to others), resumed with blocks 30..37, recomputing all
    cached = SimpleNamespace(req_ids=["R"], resumed_req_ids={"R"},
                             new_block_ids=[([30, 31, 32, 33, 34, 35, 36, 37],)], num_computed_tokens=[0])
    so2 = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                          num_scheduled_tokens={"R": 4 * CHUNK}, finished_req_ids=set())
    save = c.build_connector_meta(so2).saves[0]
    per_chunk = CHUNK // BLOCK
    blocks = {save.first_chunk + j: save.block_ids[(save.first_chunk + j) * per_chunk:
                                                    (save.first_chunk + j + 1) * per_chunk]
              for j in range(len(save.keys))}
    assert blocks == {0: [30, 31], 1: [32, 33], 2: [34, 35], 3: [36, 37]}  # its blocks now, all of it


def test_a_step_scheduled_before_a_failure_was_known_saves_nothing_over_it():
    """Async scheduling (vLLM's default on GPUs): step N+1 is scheduled before step N's invalid
    blocks are known, so it computes A's next chunk over them; only once vLLM has gone back
    (a save from at or before the failed chunk) does A save again."""
    client = FakeClient(give={"A": 1})
    c = make_connector(client)
    blocks = list(range(12))
    load = ChunkTransfer("A", client.keys_for(range(16)), 0, blocks[:4], 0)
    run_step(c, KVTierMetadata(loads=[load], saves=[ChunkTransfer("A", [b"\x02" * 16], 2, blocks[:6])]))
    run_step(c, KVTierMetadata(loads=[], saves=[ChunkTransfer("A", [b"\x03" * 16], 3, blocks[:8])]))
    assert client.committed == []  # chunk 3 attended to chunk 1's blocks, which never arrived
    again = [b"\x01" * 16, b"\x02" * 16, b"\x03" * 16]
    run_step(c, KVTierMetadata(loads=[], saves=[ChunkTransfer("A", again, 1, blocks[:8])]))
    assert client.committed == [("A", again)]  # recomputed from chunk 1: saved
