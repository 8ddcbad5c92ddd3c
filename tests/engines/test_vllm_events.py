"""The connector's KV events and metrics on their own: a real daemon whose DRAM holds two chunks
(write-through to SSD), the events built from what it answers; vLLM's own event and Prometheus
classes. (Through a real vLLM engine and its ZMQ publisher: test_vllm_conversations.py.)"""

from __future__ import annotations

import time
import types
from array import array

import pytest

pytest.importorskip("vllm")

from kvtier.engines.vllm.connector import _probe_or_raise
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


def blocks(tokens: list[int], first_block: int, n: int, after=None, parent=None) -> Blocks:
    """Blocks of ``tokens`` as vLLM would hash them (any stable hash of the prefix will do)."""
    hashes = tuple(hash(("blk", tuple(tokens[: (first_block + i + 1) * BS]))) & (2**64 - 1) for i in range(n))
    return Blocks(hashes, parent, array("q", tokens[first_block * BS : (first_block + n) * BS]), BS, after)


def follow(events: KVEvents, keys, tokens) -> None:
    for i, key in enumerate(keys):
        events.remember(key, blocks(tokens, 2 * i, 2, after=keys[i - 1] if i else None))


def apply(view: dict, events: list) -> dict:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    for ev in events:
        assert ev.ownership == "kvtier"
        for h in ev.block_hashes:
            if isinstance(ev, BlockStored):
                assert ev.medium not in view.get(h, set()), "announced twice"
                view.setdefault(h, set()).add(ev.medium)
            else:
                assert isinstance(ev, BlockRemoved) and ev.medium in view.get(h, set()), "never announced"
                view[h].discard(ev.medium)
                if not view[h]:
                    del view[h]
    return view


def test_events_follow_the_daemon_dram_to_ssd(daemon):
    client = daemon.client()
    tokens = list(range(4 * C))
    keys = client.keys_for(tokens)
    events = KVEvents(_probe_or_raise(client))
    follow(events, keys, tokens)
    events.poll()
    assert events.take() == []  # nothing saved yet: nothing announced
    client.save(tokens[: 2 * C], make_kv(LAYOUT, 2 * C, seed=1))
    events.poll()
    view = apply({}, events.take())
    first_two = [h for i in range(2) for h in blocks(tokens, 2 * i, 2).hashes]
    assert set(view) == set(first_two) and all(m == {"CPU"} for m in view.values())
    assert events.take() == []  # taken once

    client.save(tokens, make_kv(LAYOUT, 4 * C, seed=2))  # DRAM holds two: the first two go to SSD only
    events.poll()
    view = apply(view, events.take())
    held = dict(zip(keys, client.probe(keys), strict=True))
    assert {held[k] for k in keys} == {"host", "disk"}
    for i, key in enumerate(keys):
        want = {"host": {"CPU"}, "disk": {"STORAGE"}}[held[key]]
        assert all(view[h] == want for h in blocks(tokens, 2 * i, 2).hashes), (i, held[key])
    events.clear()  # (a cache reset) everything announced is removed
    assert apply(view, events.take()) == {}
    client.close()


def two_saved_chunks(daemon):
    """A client that saved two chunks of ``tokens``, their keys, and events over its probes."""
    client = daemon.client()
    tokens = list(range(2 * C))
    client.save(tokens, make_kv(LAYOUT, 2 * C, seed=3))
    return client, tokens, client.keys_for(tokens), KVEvents(_probe_or_raise(client))


def test_a_chunk_is_announced_only_with_every_chunk_before_it(daemon):
    client, tokens, keys, events = two_saved_chunks(daemon)
    events.remember(keys[1], blocks(tokens, 2, 2, after=keys[0]))  # held, but chunk 0 is not followed
    events.poll()
    assert events.take() == []  # kvtier loads runs from the first chunk: not loadable as far as known
    events.remember(keys[0], blocks(tokens, 0, 2))
    events.poll()
    assert set(apply({}, events.take())) == {h for i in range(2) for h in blocks(tokens, 2 * i, 2).hashes}
    client.close()


def test_a_block_two_chunks_cover_is_removed_with_the_last_of_them(daemon):
    client = daemon.client()
    a, b = list(range(C)), list(range(1000, 1000 + C))
    client.save(a, make_kv(LAYOUT, C, seed=4))
    client.save(b, make_kv(LAYOUT, C, seed=5))
    ka, kb = client.keys_for(a)[0], client.keys_for(b)[0]
    events = KVEvents(_probe_or_raise(client), max_chunks=2)
    shared = blocks(a, 0, 2)
    events.remember(ka, shared)
    # (as a turn's partial chunk and the next turn's full chunk cover the same first block)
    events.remember(kb, Blocks(shared.hashes[:1], None, shared.tokens[:BS], BS))
    events.poll()
    view = apply({}, events.take())
    assert set(view) == set(shared.hashes)  # the shared block once
    events.remember(client.keys_for(list(range(2000, 2000 + C)))[0], blocks(a, 0, 1))  # ka is forgotten
    view = apply(view, events.take())
    assert set(view) == set(shared.hashes[:1])  # still covered by kb
    client.close()


def test_an_unreachable_daemon_holds_nothing_after_two_polls_and_a_restart_is_announced_again(daemon):
    client, tokens, keys, events = two_saved_chunks(daemon)
    follow(events, keys, tokens)
    events.poll()
    view = apply({}, events.take())
    assert len(view) == 4
    daemon.stop()
    client.retry_s = 0.01
    events.poll()
    assert events.take() == []  # one failed poll is not a loss
    events.poll()
    view = apply(view, events.take())
    assert view == {}  # unreachable: nothing is loadable
    daemon.start()  # back, with its SSD (write-through): announced again from there
    time.sleep(0.05)
    events.poll()
    view = apply(view, events.take())
    assert len(view) == 4 and all(m == {"STORAGE"} for m in view.values())
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
