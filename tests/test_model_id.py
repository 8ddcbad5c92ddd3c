"""Model fingerprints from real files: safetensors written by the library, a fake hub cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvtier.model_id import model_fingerprint

CONFIG = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2}
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """Weight digests are kept in a KVTIER_HOME of the test's own."""
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "kvtier-home"))


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


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.gguf", "model.safetensors"])
def test_one_byte_changed_anywhere_in_a_weight_file_changes_it(tmp_path, name):
    """Two checkpoints that differ only in middle bytes of one weight file never share chunks
    (the fingerprint used to sample the first and last MiB, and missed this)."""
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    weights = root / name
    data = bytearray(5 << 20)
    weights.write_bytes(data)
    before = model_fingerprint(root)
    seen = {before}
    for offset in (0, len(data) // 2, (3 << 20) + 17, len(data) - 1):
        changed = bytearray(data)
        changed[offset] = 1
        weights.write_bytes(changed)
        got = model_fingerprint(root)
        assert got not in seen, offset
        seen.add(got)
    weights.write_bytes(data)
    assert model_fingerprint(root) == before  # the same bytes again: the same fingerprint
    weights.write_bytes(data + b"\0")
    assert model_fingerprint(root) not in seen


def test_a_checkpoint_copied_elsewhere_and_fine_tuned_in_the_middle_does_not_share(tmp_path):
    a = write_model(tmp_path / "a" / "m", tensors(big=np.zeros(1 << 20, dtype=np.float32)))
    b = tmp_path / "b" / "m"
    shutil.copytree(a, b)
    assert model_fingerprint(a) == model_fingerprint(b)
    tuned = np.zeros(1 << 20, dtype=np.float32)
    tuned[1 << 19] = 1e-3  # one weight in the middle of a 4 MiB tensor
    write_model(b, tensors(big=tuned))
    assert model_fingerprint(a) != model_fingerprint(b)


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


def test_an_unreadable_weight_file_is_a_clear_error(tmp_path):
    root = write_model(tmp_path / "m")
    (root / "model-00002.safetensors").symlink_to(tmp_path / "nowhere")
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
def test_a_weight_file_is_read_whole_once_then_its_digest_is_reused_until_it_changes(tmp_path):
    root = write_model(tmp_path / "m")
    big = root / "model-00002.safetensors"
    save_file(tensors(), str(big))
    with open(big, "r+b") as f:  # sparse: a valid header, then 256 MiB of holes
        f.truncate(256 << 20)
    start = bytes_read()
    before = model_fingerprint(root)
    assert bytes_read() - start >= 256 << 20  # every byte, the first time
    records = list((tmp_path / "kvtier-home" / "fingerprints").glob("*.json"))
    assert len(records) == 2 and all(r.stat().st_mode & 0o777 == 0o600 for r in records)
    start = bytes_read()
    assert model_fingerprint(root) == before
    assert bytes_read() - start < 1 << 20  # a scheduler, its workers, a restart: no weights read
    with open(big, "r+b") as f:  # a byte in the middle, size unchanged: mtime and ctime move
        f.seek(128 << 20)
        f.write(b"\1")
    assert model_fingerprint(root) != before
    with open(big, "r+b") as f:
        f.seek(128 << 20)
        f.write(b"\0")
    assert model_fingerprint(root) == before


def test_a_damaged_digest_record_or_an_unwritable_home_only_costs_a_hash(tmp_path, monkeypatch):
    root = write_model(tmp_path / "m")
    before = model_fingerprint(root)
    for record in (tmp_path / "kvtier-home" / "fingerprints").glob("*.json"):
        record.write_text('{"xxh3_128": "00", "v": 1')  # cut off
    assert model_fingerprint(root) == before
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("KVTIER_HOME", str(blocked))
    assert model_fingerprint(root) == before


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads with /proc/self/io")
def test_a_digest_cache_others_may_write_is_not_trusted(tmp_path):
    """Whoever can write a digest record can give a fine-tune the base model's digest -- and
    its KV: a cache directory others may write is not used (the weights are hashed each time)."""
    root = write_model(tmp_path / "m")
    big = root / "model-00002.safetensors"
    save_file(tensors(), str(big))
    with open(big, "r+b") as f:
        f.truncate(64 << 20)
    honest = model_fingerprint(root)
    cache = tmp_path / "kvtier-home" / "fingerprints"
    assert cache.stat().st_mode & 0o777 == 0o700
    for record in cache.glob("*.json"):  # someone writes a digest of their choosing
        entry = json.loads(record.read_text())
        record.write_text(json.dumps(entry | {"xxh3_128": "00" * 16}))
    os.chmod(cache, 0o777)
    start = bytes_read()
    assert model_fingerprint(root) == honest
    assert bytes_read() - start >= 64 << 20  # hashed again, the records ignored


def test_a_process_stuck_holding_a_digest_lock_does_not_stop_others(tmp_path, monkeypatch):
    import fcntl

    from kvtier import model_id

    root = write_model(tmp_path / "m")
    before = model_fingerprint(root)
    for record in (tmp_path / "kvtier-home" / "fingerprints").glob("*.json"):
        record.unlink()  # so the next call must hash, under the lock
    held = []
    for lock in (tmp_path / "kvtier-home" / "fingerprints").glob("*.lock"):
        fd = os.open(lock, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a holder that never lets go (another open file: another lock)
        held.append(fd)
    assert held
    monkeypatch.setattr(model_id, "LOCK_WAIT_S", 0.3)
    try:
        assert model_fingerprint(root) == before  # waited its bound, then hashed itself
    finally:
        for fd in held:
            os.close(fd)
