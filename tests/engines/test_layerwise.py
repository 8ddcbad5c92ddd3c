"""Layer-wise loading: cached KV arrives layer by layer while the forward pass runs, a layer that
cannot be loaded stops the pass (and the engine redoes it), and a load that always fails ends in
a plain recompute."""

import threading
import time

import pytest
import torch

from kvtier import DiskTierConfig, HostTierConfig, KVStore, StoreConfig
from kvtier.engines.layerwise import LayerwiseLoader, LoadFailed
from kvtier.tiers.disk_format import header_len_for

from ..conftest import make_kv
from .conftest import QUESTIONS, SYSTEM, assert_same_as_recompute, chunk_file

LAYER_DELAY_S = 0.01
"""Injected per layer load, standing in for an SSD read."""


def warm_chat(engine):
    """A first turn answered and saved; returns the history with the follow-up question."""
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    first = engine.generate(history)
    engine.wait_for_saves()
    return history + [{"role": "assistant", "content": first.text}, {"role": "user", "content": QUESTIONS[1]}]


class Timeline:
    """What happened, in order, across the loader thread and the forward pass."""

    def __init__(self, engine, monkeypatch, hold_last_layer: bool = False) -> None:
        self.events: list[tuple[str, object]] = []
        self.first_layer_computing = threading.Event()
        last = engine.model.config.num_hidden_layers - 1
        real_load, real_wait = engine.store.load, LayerwiseLoader.wait

        def slow_load(hit, out=None, *, layers, **kwargs):
            (layer,) = layers  # the loader asks for one layer at a time
            time.sleep(LAYER_DELAY_S)
            if hold_last_layer and layer == last:
                # Hold the last layer back until layer 0 is computing. A forward pass that waited
                # for every layer before starting would stall here until the timeout.
                self.events.append(("held", self.first_layer_computing.wait(timeout=5)))
            res = real_load(hit, out, layers=layers, **kwargs)
            self.events.append(("loaded", layer))
            return res

        def logged_wait(loader, layer):
            kv = real_wait(loader, layer)
            self.events.append(("computing", layer))
            if layer == 0:
                self.first_layer_computing.set()
            return kv

        monkeypatch.setattr(engine.store, "load", slow_load)
        monkeypatch.setattr(LayerwiseLoader, "wait", logged_wait)

    def at(self, event: tuple[str, object]) -> int:
        return self.events.index(event)


def test_layer_0_computes_while_the_last_layer_is_still_loading(tiny, make_engine, monkeypatch):
    engine = make_engine(host_chunks=256)
    history = warm_chat(engine)
    layers = tiny.model.config.num_hidden_layers
    timeline = Timeline(engine, monkeypatch, hold_last_layer=True)

    got = engine.generate(history)
    assert got.hit_tokens > 0
    assert ("held", True) in timeline.events  # layer 0 was computing before the last layer loaded
    assert timeline.at(("computing", 0)) < timeline.at(("loaded", layers - 1))
    for layer in range(layers):  # and no layer was used before it was in memory
        assert timeline.at(("loaded", layer)) < timeline.at(("computing", layer))
    assert got.load_s > 0
    assert 0.0 <= got.load_hidden <= 1.0
    assert_same_as_recompute(got, engine.generate(history, use_store=False))


def test_without_layerwise_loading_everything_is_loaded_before_compute(tiny, make_engine, monkeypatch):
    engine = make_engine(host_chunks=256, layerwise=False)
    history = warm_chat(engine)
    layers = tiny.model.config.num_hidden_layers
    timeline = Timeline(engine, monkeypatch)

    got = engine.generate(history)
    assert got.hit_tokens > 0
    first_compute = timeline.at(("computing", 0))
    assert all(timeline.at(("loaded", layer)) < first_compute for layer in range(layers))
    assert got.load_s > 0
    assert_same_as_recompute(got, engine.generate(history, use_store=False))


def test_without_layerwise_loading_no_load_time_is_reported_hidden(make_engine, monkeypatch):
    # TurnResult.load_hidden is "the share of load_s that compute hid". Loading everything
    # before the forward pass hides none of it: the whole load shows in time-to-first-token.
    engine = make_engine(host_chunks=256, layerwise=False)
    history = warm_chat(engine)
    Timeline(engine, monkeypatch)

    got = engine.generate(history)
    assert got.hit_tokens > 0 and got.load_s > 0
    assert got.load_hidden == pytest.approx(0.0, abs=0.05)


def test_a_load_failing_midway_is_retried_and_the_output_is_right(make_engine, monkeypatch, caplog):
    engine = make_engine(host_chunks=256)
    history = warm_chat(engine)
    store = engine.store
    cached = store.lookup(engine.prompt_ids(history)[:-1]).hit_tokens
    real_load = store.load
    calls: list[int] = []

    def flaky_load(hit, out=None, *, layers, **kwargs):
        calls.append(layers[0])
        if len(calls) == 2:  # layer 1 of the first attempt: layer 0 is already computing
            raise OSError("SSD went away")
        return real_load(hit, out, layers=layers, **kwargs)

    monkeypatch.setattr(store, "load", flaky_load)
    got = engine.generate(history)
    assert got.retries == 1
    assert calls == [0, 1, 0, 1]  # the whole prefix loaded again on the retry
    assert got.hit_tokens == cached > 0  # nothing was lost: the retry hits as much
    assert any("cached KV unreadable" in r.getMessage() for r in caplog.records)
    assert_same_as_recompute(got, engine.generate(history, use_store=False))


def test_a_load_that_keeps_failing_ends_in_a_full_recompute(make_engine, monkeypatch):
    engine = make_engine(host_chunks=256)
    history = warm_chat(engine)

    def broken_load(*args, **kwargs):
        raise OSError("SSD went away")

    monkeypatch.setattr(engine.store, "load", broken_load)
    got = engine.generate(history)
    assert got.retries == engine.MAX_LOAD_RETRIES
    assert (got.hit_tokens, got.tier, got.tier_tokens) == (0, "-", {})
    assert_same_as_recompute(got, engine.generate(history, use_store=False))


# -- the loader on its own ----------------------------------------------------------------------
def test_the_loader_hands_each_layer_exactly_what_was_saved(layout):
    tokens = list(range(3 * layout.chunk_tokens + 5))
    kv = make_kv(layout, len(tokens))
    with KVStore(StoreConfig(model="m@1", layout=layout, host=HostTierConfig(8 * layout.chunk_bytes))) as store:
        store.save(tokens, kv)
        hit = store.lookup(tokens)
        loader = LayerwiseLoader(store, hit)
        n = hit.hit_tokens
        for layer in reversed(range(layout.num_layers)):  # any order: each waits for its own layer
            k, v = loader.wait(layer)
            assert k.shape == (1, layout.num_kv_heads, n, layout.head_dim)
            assert torch.equal(k[0], kv[layer][0][:, :n]) and torch.equal(v[0], kv[layer][1][:, :n])
        loader.join()
        assert loader.load_s > 0 and 0.0 <= loader.hidden_fraction <= 1.0


def test_a_prefix_loaded_layer_by_layer_counts_its_tokens_once(layout):
    # StoreStats.loaded_tokens is tokens served per tier; reading them one layer at a time is
    # still reading each token once.
    tokens = list(range(3 * layout.chunk_tokens))
    with KVStore(StoreConfig(model="m@1", layout=layout, host=HostTierConfig(4 * layout.chunk_bytes))) as store:
        store.save(tokens, make_kv(layout, len(tokens)))
        loader = LayerwiseLoader(store, store.lookup(tokens))
        loader.join()
        assert store.snapshot()["loaded_tokens"] == {"host": len(tokens)}


def test_a_chunk_lost_on_ssd_makes_every_layer_fail_to_load(layout, tmp_path):
    c = layout.chunk_tokens
    tokens = list(range(3 * c))
    per_chunk = header_len_for(layout.num_layers) + layout.chunk_bytes
    config = StoreConfig(model="m@1", layout=layout, host=HostTierConfig(layout.chunk_bytes),
                         disk=DiskTierConfig(str(tmp_path), 16 * per_chunk))
    with KVStore(config) as store:
        store.save(tokens, make_kv(layout, len(tokens)))  # chunks 0 and 1 go down to SSD
        hit = store.lookup(tokens)
        assert hit.tiers == ["disk", "disk", "host"]
        chunk_file(tmp_path, hit.keys[1]).unlink()

        loader = LayerwiseLoader(store, hit)
        with pytest.raises(LoadFailed, match=f"layer 0: only {c} of {3 * c}"):
            loader.wait(0)
        for layer in range(1, layout.num_layers):  # the pass is doomed: later layers are not read
            with pytest.raises(LoadFailed, match=f"layer {layer}: only 0 of {3 * c}"):
                loader.wait(layer)
        loader.join()
        assert store.lookup(tokens).hit_tokens == c  # the lost chunk has left the index


def test_a_load_error_reaches_the_forward_pass_as_LoadFailed(layout, monkeypatch):
    tokens = list(range(2 * layout.chunk_tokens))
    with KVStore(StoreConfig(model="m@1", layout=layout, host=HostTierConfig(4 * layout.chunk_bytes))) as store:
        store.save(tokens, make_kv(layout, len(tokens)))
        hit = store.lookup(tokens)
        boom = OSError("device error")

        def broken_load(*args, **kwargs):
            raise boom

        monkeypatch.setattr(store, "load", broken_load)
        loader = LayerwiseLoader(store, hit)
        with pytest.raises(LoadFailed) as failed:
            loader.wait(0)
        assert failed.value.__cause__ is boom
        loader.join()
