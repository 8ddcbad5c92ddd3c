"""Model fingerprints from real files: safetensors written by the library, a fake hub cache."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvtier.model_id import model_fingerprint

CONFIG = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2}
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def tensors(**changes: np.ndarray) -> dict[str, np.ndarray]:
    base = {
        "embed.weight": np.arange(32, dtype=np.float32).reshape(4, 8),
        "lm_head.weight": np.ones((8, 4), dtype=np.float32),
    }
    return base | changes


def write_model(root: Path, weights: dict[str, np.ndarray] | None = None,
                config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    save_file(weights or tensors(), str(root / "model.safetensors"))
    (root / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    return root


def test_the_same_files_in_two_places_agree(tmp_path):
    a = write_model(tmp_path / "a" / "tiny")
    b = tmp_path / "b" / "tiny"
    shutil.copytree(a, b)
    assert model_fingerprint(a) == model_fingerprint(str(b))
    assert model_fingerprint(a).startswith("tiny@")
    assert len(model_fingerprint(a).split("@")[1]) == 16


@pytest.mark.parametrize("change", [
    {"embed.weight": np.arange(32, dtype=np.float32).reshape(8, 4)},  # same bytes, other shape
    {"lm_head.weight": np.ones((8, 4), dtype=np.float32).view(np.int32)},  # other dtype
    {"embed.weight": np.zeros((4, 4), dtype=np.float32)},  # other offsets and file size
    {"embed.weight": np.arange(32, dtype=np.float32).reshape(4, 8) * 2},  # a fine-tune
])
def test_any_weight_change_in_a_small_file_changes_it(tmp_path, change):
    before = model_fingerprint(write_model(tmp_path / "a" / "m"))
    assert model_fingerprint(write_model(tmp_path / "b" / "m", tensors(**change))) != before


def test_a_config_change_changes_it(tmp_path):
    before = model_fingerprint(write_model(tmp_path / "a" / "m"))
    after = model_fingerprint(write_model(tmp_path / "b" / "m", config=CONFIG | {"rope_theta": 1e6}))
    assert after != before


def test_tokenizer_and_generation_files_do_not_count(tmp_path):
    root = write_model(tmp_path / "m")
    before = model_fingerprint(root)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "special_tokens_map.json", "kvtier.json"):
        (root / name).write_text('{"changed": true}')
    assert model_fingerprint(root) == before
    (root / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert model_fingerprint(root) != before


def test_a_bin_only_model_is_sampled_at_both_ends(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    weights = root / "pytorch_model.bin"
    data = bytearray(5 << 20)
    weights.write_bytes(data)
    before = model_fingerprint(root)
    for offset, same in ((0, False), (len(data) - 1, False), (len(data) // 2, True)):
        changed = bytearray(data)
        changed[offset] = 1
        weights.write_bytes(changed)
        assert (model_fingerprint(root) == before) is same, offset
    weights.write_bytes(data + b"\0")
    assert model_fingerprint(root) != before


def fake_hub(cache: Path, repo: str, revisions: dict[str, Path]) -> None:
    """A hub cache as huggingface_hub lays it out: snapshot files are symlinks into blobs/."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    for i, (ref, source) in enumerate(revisions.items()):
        commit = f"{i:x}" * 40
        (folder / "refs" / ref).write_text(commit)
        snapshot = folder / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in source.iterdir():
            blob = folder / "blobs" / f"{commit[:8]}-{file.name}"
            shutil.copy(file, blob)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_is_found_in_the_local_cache(tmp_path, monkeypatch, env):
    local = write_model(tmp_path / "local" / "SmolLM2-135M-Instruct")
    cache = tmp_path / "hf" / "hub"
    fake_hub(cache, REPO, {"main": local})
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(env, str(cache if env == "HF_HUB_CACHE" else cache.parent))
    assert model_fingerprint(REPO) == model_fingerprint(local)


def test_a_hub_id_may_name_a_revision(tmp_path, monkeypatch):
    main = write_model(tmp_path / "main" / "m")
    v2 = write_model(tmp_path / "v2" / "m", config=CONFIG | {"hidden_size": 16})
    fake_hub(tmp_path / "hub", REPO, {"main": main, "v2": v2})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_fingerprint(f"{REPO}@main") == model_fingerprint(REPO)
    assert model_fingerprint(f"{REPO}@v2") != model_fingerprint(REPO)
    assert model_fingerprint(f"{REPO}@{'1' * 40}") == model_fingerprint(f"{REPO}@v2")
    with pytest.raises(ValueError, match="revision 'v3'"):
        model_fingerprint(f"{REPO}@v3")


def test_what_cannot_be_found_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="neither a directory nor in the local Hugging Face cache"):
        model_fingerprint("nobody/nothing")
    with pytest.raises(ValueError, match=str(tmp_path / "hub")):
        model_fingerprint("nobody/nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"{tmp_path / 'empty'}.*no config.json"):
        model_fingerprint(tmp_path / "empty")


@pytest.mark.parametrize("damage", [
    b"\x05",  # shorter than the length field
    struct.pack("<Q", 1 << 40) + b"{}",  # length past the end of the file
    struct.pack("<Q", 6) + b"{nope}",  # not JSON
    struct.pack("<Q", 2) + b"[]",  # JSON, not an object
])
def test_a_damaged_safetensors_header_is_a_clear_error(tmp_path, damage):
    root = write_model(tmp_path / "m")
    (root / "model-00002.safetensors").write_bytes(damage)
    with pytest.raises(ValueError, match="model-00002.safetensors"):
        model_fingerprint(root)


def test_importing_it_pulls_in_no_engine():
    code = ("import kvtier.model_id, sys; assert 'transformers' not in sys.modules and "
            "not any(m.startswith('kvtier.engines') for m in sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads with /proc/self/io")
@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_large_weight_file_is_sampled_not_read_whole(tmp_path, name):
    root = write_model(tmp_path / "m")
    big = root / name
    save_file(tensors(), str(big))
    with open(big, "r+b") as f:  # sparse: a valid header, then 1 GiB of holes
        f.truncate(1 << 30)
    start, began = bytes_read(), time.perf_counter()
    before = model_fingerprint(root)
    assert bytes_read() - start < 3 << 20
    assert time.perf_counter() - began < 2
    with open(big, "r+b") as f:  # the same header and the same (zero) bytes at both ends
        f.truncate((1 << 30) + 4096)
    assert model_fingerprint(root) != before
