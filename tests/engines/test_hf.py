"""The transformers engine, told as chats on the tiny model: every turn served from kvtier (DRAM
or SSD) gives exactly what a full recompute gives, later turns hit what earlier turns saved,
damaged chunks cost a retry and never a wrong token, and saves never hold up a reply."""

import logging
import threading
from dataclasses import replace
from itertools import pairwise

import pytest
import torch

from kvtier import HostTierConfig, KVStore, StoreConfig
from kvtier.engines.hf import HFEngine, kv_layout_for, model_fingerprint
from kvtier.tiers.disk_format import header_len_for

from .conftest import (
    QUESTIONS,
    SYSTEM,
    C,
    assert_same_as_recompute,
    chunk_file,
    converse,
    prefill_lengths,
    saved_tokens,
)


# -- correctness and hits ---------------------------------------------------------------------
def test_a_chat_served_from_dram_matches_a_full_recompute_turn_by_turn(make_engine):
    engine = make_engine(host_chunks=256)
    turns = converse(engine, QUESTIONS)

    first = turns[0]
    assert first.got.prompt_tokens > 10 * C  # the chat spans many chunks from the start
    assert (first.got.hit_tokens, first.got.tier, first.got.tier_tokens) == (0, "-", {})
    for prev, turn in pairwise(turns):
        got = turn.got
        assert_same_as_recompute(got, turn.baseline)
        # The reply, rendered into the history, tokenizes back to the very tokens generated, so
        # the next turn hits every full chunk the previous turn saved.
        prev_ids = engine.prompt_ids(prev.history)
        fed = prev_ids + prev.got.token_ids[:-1]
        assert engine.prompt_ids(turn.history)[: len(fed)] == fed
        assert got.hit_tokens == saved_tokens(prev.got) // C * C > 0
        assert got.hit_tokens < got.prompt_tokens
        assert (got.tier, got.tier_tokens, got.retries) == ("host", {"host": got.hit_tokens}, 0)
    assert_same_as_recompute(first.got, first.baseline)
    assert engine.store.snapshot()["load_failures"] == 0


def test_only_the_uncached_tokens_are_prefilled(tiny, make_engine):
    engine = make_engine(host_chunks=256)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    first = engine.generate(history)
    engine.wait_for_saves()
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": QUESTIONS[1]}]

    with prefill_lengths(tiny.model) as seen:
        second = engine.generate(history)
    assert second.hit_tokens > 0
    assert seen[0] == second.prompt_tokens - second.hit_tokens  # the prefill
    assert seen[1:] == [1] * (len(second.token_ids) - 1)  # then one token per decode step

    with prefill_lengths(tiny.model) as seen:
        full = engine.generate(history, use_store=False)
    assert (full.hit_tokens, seen[0]) == (0, full.prompt_tokens)

    # A prompt one token past a chunk boundary: everything but that token comes from the cache.
    ids = engine.prompt_ids(history)[: 3 * C + 1]
    engine.generate(prompt_ids=ids)
    engine.wait_for_saves()
    with prefill_lengths(tiny.model) as seen:
        last = engine.generate(prompt_ids=ids)
    assert (last.hit_tokens, seen[0]) == (3 * C, 1)
    assert_same_as_recompute(last, engine.generate(prompt_ids=ids, use_store=False))


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "load-first"])
def test_a_chat_served_from_ssd_matches_a_full_recompute(make_engine, tmp_path, layerwise):
    # DRAM holds two chunks: everything older than the last two chunks is read from SSD.
    engine = make_engine(host_chunks=2, disk_path=tmp_path / "ssd", layerwise=layerwise)
    turns = converse(engine, QUESTIONS)

    for prev, turn in pairwise(turns):
        got = turn.got
        assert_same_as_recompute(got, turn.baseline)
        assert got.hit_tokens == saved_tokens(prev.got) // C * C > 0
        assert got.tier == "disk"
        assert got.tier_tokens["disk"] >= got.hit_tokens - 2 * C
        assert sum(got.tier_tokens.values()) == got.hit_tokens
    snap = engine.store.snapshot()
    assert snap["loaded_tokens"]["disk"] > 0
    assert snap["tiers"]["disk"]["io"]["bytes_read"] > 0
    assert snap["load_failures"] == 0


def test_the_stores_hit_counters_agree_with_the_turns_served(make_engine):
    # The store's lookup counters are its hit rate (what a metrics endpoint reports): they should
    # count the requests' lookups, not bookkeeping the engine does around its saves.
    engine = make_engine(host_chunks=256)
    turns = converse(engine, QUESTIONS[:3])

    snap = engine.store.snapshot()
    assert snap["lookups"] == len(turns)
    assert snap["lookup_tokens"] == sum(t.got.prompt_tokens - 1 for t in turns)  # the last is computed
    assert snap["hit_tokens"] == sum(t.got.hit_tokens for t in turns)


def test_a_shared_system_prompt_hits_for_a_second_user(make_engine):
    engine = make_engine(host_chunks=256)
    system = SYSTEM * 3
    alice = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
    bob = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[2]}]
    engine.generate(alice)
    engine.wait_for_saves()

    alice_ids, bob_ids = engine.prompt_ids(alice), engine.prompt_ids(bob)
    common = next(i for i, (a, b) in enumerate(zip(alice_ids, bob_ids)) if a != b)
    got = engine.generate(bob)
    assert got.hit_tokens == common // C * C > 0
    assert_same_as_recompute(got, engine.generate(bob, use_store=False))


# -- damaged chunks on SSD --------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_a_damaged_chunk_on_ssd_costs_a_retry_never_a_wrong_token(make_engine, tmp_path, damage):
    ssd = tmp_path / "ssd"
    engine = make_engine(host_chunks=2, disk_path=ssd)
    store = engine.store
    turns = converse(engine, QUESTIONS[:2])
    history = turns[-1].history + [
        {"role": "assistant", "content": turns[-1].got.text},
        {"role": "user", "content": QUESTIONS[2]},
    ]
    ids = engine.prompt_ids(history)
    cached = store.lookup(ids[:-1])
    bad = 3
    assert cached.tiers[bad] == "disk" and len(cached.keys) > bad + 2

    path = chunk_file(ssd, cached.keys[bad])
    if damage == "corrupt":  # one byte of layer 1: layer 0 loads fine, the pass fails mid-way
        offset = header_len_for(store.layout.num_layers) + store.layout.layer_offset(1) + 7
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        path.unlink()

    baseline = engine.generate(history, use_store=False)
    got = engine.generate(history)
    assert_same_as_recompute(got, baseline)
    assert got.retries == 1
    assert got.hit_tokens == bad * C  # the prefix before the damage still served
    assert store.stats.load_failures >= 1
    io = store.snapshot()["tiers"]["disk"]["io"]
    assert io["errors"] == 1
    assert io["corrupt"] == (1 if damage == "corrupt" else 0)

    # The turn saved the chunk again: the next request hits its whole prompt.
    engine.wait_for_saves()
    again = engine.generate(history)
    assert (again.hit_tokens, again.retries) == ((got.prompt_tokens - 1) // C * C, 0)
    assert_same_as_recompute(again, baseline)


# -- setup and arguments ----------------------------------------------------------------------
MISMATCHES = {
    "dtype": {"dtype": "float16"},  # the model computes (and would hand over) float32 KV
    "layers": {"num_layers": 3},
    "kv-heads": {"num_kv_heads": 4},
    "head-dim": {"head_dim": 64},
}


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_a_store_whose_layout_does_not_match_the_model_is_refused(tiny, what):
    right = kv_layout_for(tiny.model.config, C)
    layout = replace(right, **MISMATCHES[what])
    assert layout != right
    config = StoreConfig(model=model_fingerprint(tiny.path), layout=layout, host=HostTierConfig(1 << 20))
    with KVStore(config) as store, pytest.raises(ValueError, match="does not match"):
        HFEngine(tiny.path, store, model=tiny.model, tokenizer=tiny.tokenizer)


def test_generate_checks_its_arguments(make_engine):
    engine = make_engine()
    chat = [{"role": "user", "content": "Hi"}]
    ids = engine.prompt_ids(chat)
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate(chat, prompt_ids=ids)
    with pytest.raises(ValueError, match="empty"):
        engine.generate(prompt_ids=[])
    by_ids = engine.generate(prompt_ids=ids, max_new_tokens=3)
    assert by_ids.token_ids == engine.generate(chat, max_new_tokens=3, use_store=False).token_ids
    assert len(by_ids.token_ids) <= 3
    one = engine.generate(prompt_ids=ids[:1], max_new_tokens=2)  # nothing to look up
    assert one.hit_tokens == 0 and one.prompt_tokens == 1


# -- asynchronous saving ----------------------------------------------------------------------
def test_saves_run_in_the_background_and_never_hold_up_a_reply(make_engine, monkeypatch):
    engine = make_engine(host_chunks=256)
    store = engine.store
    gate, started, finished = threading.Event(), threading.Event(), threading.Event()
    real_save = store.save

    def slow_save(*args, **kwargs):
        started.set()
        gate.wait(timeout=10)
        try:
            return real_save(*args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(store, "save", slow_save)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    first = engine.generate(chat)
    assert started.wait(timeout=10)
    assert not finished.is_set()  # the reply came back while its KV was still being saved

    meanwhile = engine.generate(chat)  # nothing saved yet: no hit, same answer
    assert meanwhile.hit_tokens == 0
    assert meanwhile.token_ids == first.token_ids

    gate.set()
    engine.wait_for_saves()
    assert finished.is_set()
    later = engine.generate(chat)
    assert later.hit_tokens == (first.prompt_tokens - 1) // C * C > 0
    assert later.token_ids == first.token_ids


def test_a_failed_save_is_logged_and_the_next_request_still_works(make_engine, monkeypatch, caplog):
    engine = make_engine(host_chunks=256)
    store = engine.store
    real_save = store.save
    failures = []

    def failing_save(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise OSError("no space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(store, "save", failing_save)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    first = engine.generate(chat)
    engine.wait_for_saves()  # the failure stays in the background
    errors = [r for r in caplog.records if r.name == "kvtier.engines.hf" and r.levelno == logging.ERROR]
    assert len(errors) == 1 and "saving KV failed" in errors[0].getMessage()
    assert "no space left" in str(errors[0].exc_info[1])

    second = engine.generate(chat)  # the lost save is just a miss
    assert second.hit_tokens == 0 and second.token_ids == first.token_ids
    engine.wait_for_saves()
    third = engine.generate(chat)  # the second save went through
    assert third.hit_tokens > 0 and third.token_ids == first.token_ids
    assert torch.allclose(third.first_logits, first.first_logits, rtol=0, atol=1e-5)
