"""The connector's KV events and metrics on their own: a real daemon whose DRAM holds two chunks
(write-through to SSD), the events built from what it answers; vLLM's own event and Prometheus
classes. (Through a real vLLM engine and its ZMQ publisher: test_vllm_conversations.py.)"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from kvtier.engines.vllm.events import Blocks, KVEvents
from kvtier.engines.vllm.stats import Deltas, KVTierPromMetrics, KVTierStats

from ..conftest import make_kv
from ..server.test_daemon import LAYOUT, Daemon

C = LAYOUT.chunk_tokens
BS = 8  # vLLM block size: two blocks a chunk


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path, host_chunks=2).start()
    yield d
    d.stop()


def blocks(tokens: list[int], first_block: int, n: int, parent=None) -> Blocks:
    hashes = tuple(hash(("blk", tuple(tokens[: (first_block + i + 1) * BS]))) & (2**64 - 1) for i in range(n))
    return Blocks(hashes, parent, tuple(tokens[first_block * BS : (first_block + n) * BS]), BS)


def apply(view: dict, events: list) -> dict:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    for ev in events:
        assert ev.ownership == "kvtier"
        for h in ev.block_hashes:
            if isinstance(ev, BlockStored):
                assert ev.medium not in view.get(h, set())
                view.setdefault(h, set()).add(ev.medium)
            else:
                assert isinstance(ev, BlockRemoved) and ev.medium in view.get(h, set())
                view[h].discard(ev.medium)
                if not view[h]:
                    del view[h]
    return view


def test_events_follow_the_daemon_dram_to_ssd_and_count_blocks_two_chunks_share(daemon):
    client = daemon.client()
    tokens = list(range(4 * C))
    keys = client.keys_for(tokens)
    events = KVEvents(client.probe)
    for i, key in enumerate(keys):
        events.remember(key, blocks(tokens, 2 * i, 2))
    events.poll()
    assert events.take() == []  # nothing saved yet: nothing announced
    client.save(tokens[: 2 * C], make_kv(LAYOUT, 2 * C, seed=1))
    events.poll()
    view = apply({}, events.take())
    first_two = [h for i in range(2) for h in blocks(tokens, 2 * i, 2).hashes]
    assert set(view) == set(first_two) and all(m == {"CPU"} for m in view.values())

    client.save(tokens, make_kv(LAYOUT, 4 * C, seed=2))  # DRAM holds two: the first two go to SSD only
    events.poll()
    view = apply(view, events.take())
    held = dict(zip(keys, client.probe(keys), strict=True))
    for i, key in enumerate(keys):
        want = {"host": {"CPU"}, "disk": {"STORAGE"}}[held[key]]
        assert all(view[h] == want for h in blocks(tokens, 2 * i, 2).hashes), (i, held[key])
    assert {held[k] for k in keys} == {"host", "disk"}

    # a partial chunk (the first block of chunk 3) covers a block chunk 3 covers: one announcement
    tail = client.keys_for(tokens[: 3 * C] + [7] * C)[3]  # a key the daemon does not hold
    events.remember(tail, blocks(tokens, 6, 1))
    events.poll()
    assert events.take() == []
    events.clear()  # (a cache reset) everything announced is removed, each block once
    assert apply(view, events.take()) == {}
    client.close()


def test_a_chunk_no_longer_followed_is_removed_and_an_unreachable_daemon_holds_nothing(daemon):
    client = daemon.client()
    tokens = list(range(2 * C))
    client.save(tokens, make_kv(LAYOUT, 2 * C, seed=3))
    keys = client.keys_for(tokens)
    events = KVEvents(client.probe, max_chunks=1)
    events.remember(keys[0], blocks(tokens, 0, 2))
    events.poll()
    view = apply({}, events.take())
    assert len(view) == 2
    events.remember(keys[1], blocks(tokens, 2, 2))  # past max_chunks: chunk 0 is forgotten
    view = apply(view, events.take())
    assert view == {}
    events.poll()
    view = apply(view, events.take())
    assert set(view) == set(blocks(tokens, 2, 2).hashes)
    daemon.stop()  # unreachable: nothing is loadable
    client.retry_s = 0.01
    events.poll()
    assert apply(view, events.take()) == {}
    daemon.start()  # back, with its SSD: announced again from there
    import time

    time.sleep(0.05)
    events.poll()
    view = apply(view, events.take())
    assert set(view) == set(blocks(tokens, 2, 2).hashes) and all(m == {"STORAGE"} for m in view.values())
    client.close()


def test_stats_carry_deltas_and_a_gauge_back_at_zero():
    deltas = Deltas()
    assert deltas.since_last({"lookups": 0}, {"save_backlog_requests": 0}) is None
    s = deltas.since_last({"lookups": 3, "hit_tokens:host": 128}, {"save_backlog_requests": 2})
    assert s is not None and s.data == {"lookups": 3, "hit_tokens:host": 128, "save_backlog_requests": 2}
    assert deltas.since_last({"lookups": 3, "hit_tokens:host": 128}, {"save_backlog_requests": 2}) is None
    back = deltas.since_last({"lookups": 4, "hit_tokens:host": 128}, {"save_backlog_requests": 0})
    assert back is not None and back.data == {"lookups": 1, "save_backlog_requests": 0} and not back.is_empty()
    total = KVTierStats(data={"lookups": 1, "save_backlog_requests": 3}).aggregate(
        KVTierStats(data={"lookups": 2, "loaded_bytes": 10, "save_backlog_requests": 1}))
    assert total.data == {"lookups": 3, "loaded_bytes": 10, "save_backlog_requests": 1}
    assert KVTierStats().is_empty()


def test_prometheus_metrics_are_vllm_named_per_engine_and_per_tier():
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    try:
        prom = KVTierPromMetrics(types.SimpleNamespace(kv_transfer_config=None),
                                 {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
                                 ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
        prom.observe({"lookups": 2, "hit_tokens:host": 64, "hit_tokens:disk": 32, "save_backlog_requests": 1}, 0)
        prom.observe({"lookups": 1, "hit_tokens:host": 16, "save_backlog_requests": 0}, 0)
        prom.observe({"lookups": 5}, 1)
        text = generate_latest(REGISTRY).decode()
        assert 'vllm:kvtier_lookups_total{engine="0",model_name="m"} 3.0' in text
        assert 'vllm:kvtier_lookups_total{engine="1",model_name="m"} 5.0' in text
        assert 'vllm:kvtier_hit_tokens_total{engine="0",model_name="m",tier="host"} 80.0' in text
        assert 'vllm:kvtier_hit_tokens_total{engine="0",model_name="m",tier="disk"} 32.0' in text
        assert 'vllm:kvtier_save_backlog_requests{engine="0",model_name="m"} 0.0' in text
    finally:
        unregister_vllm_metrics()
