"""The model part of a vLLM engine's keys, from vLLM's own config of the tiny model: it changes
with everything that changes KV (weights anywhere in a file, hf_overrides, RoPE scaling, the KV
cache dtype) and not with what does not (the context limit of an unscaled RoPE)."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs

from kvtier.engines.vllm.namespace import engine_model_id, engine_settings, model_reference

LINEAR = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "kvtier-home"))


def config(model_dir, **kw):
    return EngineArgs(model=str(model_dir), dtype="float32", enforce_eager=True, **kw).create_engine_config()


def test_everything_that_changes_kv_changes_the_model_id(tiny_model_dir, tmp_path):
    plain = config(tiny_model_dir)
    base = engine_model_id(plain)
    assert base.startswith("kvtier-llama-tiny") and "+" in base
    assert engine_model_id(plain) == base  # stable
    # a worker builds its connector after loading the model, and loading may change hf_config
    # in place (in that worker's copy only): the id is made of vLLM's inputs, so it agrees
    plain.model_config.hf_config.num_ln_in_parallel_attn = 2
    assert engine_model_id(plain) == base
    changed = {
        "hf_overrides": engine_model_id(config(tiny_model_dir, hf_overrides={"rms_norm_eps": 1e-3})),
        "rope": engine_model_id(config(tiny_model_dir, hf_overrides=LINEAR, max_model_len=64)),
        "kv_cache_dtype": engine_model_id(config(tiny_model_dir, kv_cache_dtype="fp8", max_model_len=64)),
    }
    assert base not in changed.values() and len(set(changed.values())) == 3, changed
    # the context limit changes nothing while RoPE is not scaled (fp8 above ran with 64); with a
    # scaling it may
    assert "max_model_len" not in engine_settings(plain)
    scaled = engine_settings(config(tiny_model_dir, hf_overrides=LINEAR, max_model_len=64))
    assert scaled["max_model_len"] == 64
    assert engine_model_id(config(tiny_model_dir, max_model_len=64, kv_cache_dtype="auto")) == base
    # a copy of the checkpoint agrees; a byte changed in the middle of its weights does not
    copy = tmp_path / tiny_model_dir.name
    shutil.copytree(tiny_model_dir, copy)
    copied = config(copy)
    assert engine_model_id(copied).split("@")[1] == base.split("@")[1]
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(data)
    assert engine_model_id(copied).split("@")[1].split("+")[0] != base.split("@")[1].split("+")[0]


def test_a_hub_model_is_fingerprinted_at_the_revision_vllm_serves():
    class Model:
        model, revision = "HuggingFaceTB/SmolLM2-135M-Instruct", "v2"

    assert model_reference(Model) == "HuggingFaceTB/SmolLM2-135M-Instruct@v2"
    Model.revision = None
    assert model_reference(Model) == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_what_the_id_cannot_see_is_refused_and_sliding_windows_count(tiny_model_dir):
    # a callable override may change anything: two of one name could differ, so no id is guessed
    with pytest.raises(ValueError, match="model_id"):
        engine_model_id(config(tiny_model_dir, hf_overrides=lambda c: c))
    assert engine_settings(config(tiny_model_dir))["disable_sliding_window"] is False
    assert engine_settings(config(tiny_model_dir, disable_sliding_window=True))["disable_sliding_window"] is True
