"""Engines over one store daemon: a transformers engine whose chats hit the daemon, a daemon
stalled under its load (never wrong KV: the same output as a full recompute), and one daemon
started with no model serving vLLM and a transformers engine of two different models at once."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from kvtier.engines.default_model import default_model_dir
from kvtier.engines.hf import EngineConfig, HFEngine

from ..daemon_process import DaemonProcess
from ..engines.conftest import QUESTIONS, assert_same_as_recompute, converse
from .test_leases import wait_until


class Serve(DaemonProcess):
    """``kvtier store serve`` with flags only: no config file, no model."""

    def __init__(self, tmp: Path, host: str = "64MiB", disk: str = "256MiB") -> None:
        super().__init__(tmp / "unused.toml", tmp / "kv.sock", tmp / "daemon.log")
        self.args = ["--socket", str(self.socket), "--host-bytes", host, "--disk-path", str(tmp / "ssd"),
                     "--disk-bytes", disk]

    def start(self) -> Serve:
        import subprocess

        from ..daemon_process import KVTIER, wait_for_socket

        with open(self.log, "a") as err:
            self.proc = subprocess.Popen([KVTIER, "store", "serve", *self.args], stderr=err, text=True)
        wait_for_socket(self.socket, self.proc)
        return self


@pytest.fixture(scope="module")
def mini_model_dir(tmp_path_factory):
    return default_model_dir("mini", home=tmp_path_factory.mktemp("kvtier-home-mini"))


def test_a_transformers_engine_over_the_daemon_hits_its_history(tiny_model_dir, tmp_path):
    daemon = Serve(tmp_path).start()
    engine = HFEngine.connect(tiny_model_dir, str(daemon.socket), chunk_tokens=16,
                              config=EngineConfig(max_new_tokens=8))
    try:
        turns = converse(engine, QUESTIONS[:3])
        for turn in turns:
            assert_same_as_recompute(turn.got, turn.baseline)
        assert turns[0].got.hit_tokens == 0
        assert turns[1].got.hit_tokens > turns[0].got.prompt_tokens // 2
        assert turns[2].got.hit_tokens > turns[1].got.prompt_tokens // 2
        assert daemon.stats()["loaded_tokens"]["host"] >= turns[1].got.hit_tokens
    finally:
        engine.close()
        daemon.stop()


def test_a_daemon_stalled_under_a_load_never_lets_wrong_kv_reach_the_model(tiny_model_dir, tmp_path):
    """Fault injected: right after the daemon hands the engine's loader the views of its hit,
    the daemon stalls past the client's timeout (SIGSTOP), comes back, ends the lost lease, and
    another client fills those DRAM slots with other chunks. The engine must notice and
    prefill again with what is still cached: its output is that of a full recompute."""
    daemon = Serve(tmp_path, host="256KiB").start()
    engine = HFEngine.connect(tiny_model_dir, str(daemon.socket), chunk_tokens=16,
                              config=EngineConfig(max_new_tokens=8))
    client = engine.store
    client.timeout_s, client.retry_s = 0.5, 0.05  # type: ignore[union-attr]
    other = HFEngine.connect(tiny_model_dir, str(daemon.socket), chunk_tokens=16,
                             config=EngineConfig(max_new_tokens=8, async_save=False),
                             model=engine.model, tokenizer=engine.tokenizer)
    try:
        history = [{"role": "system", "content": "You keep answers short. " * 3},
                   {"role": "user", "content": QUESTIONS[0]}]
        first = engine.generate(history)
        engine.wait_for_saves()
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": QUESTIONS[1]}]
        baseline = engine.generate(history, use_store=False)
        real = client.acquire  # type: ignore[union-attr]
        stalled = []

        def acquire_then_stall(*args, **kw):
            lease = real(*args, **kw)
            if lease is not None and not stalled:
                stalled.append(lease)
                daemon.pause()
                try:
                    assert client.lookup([1, 2, 3]).hit_tokens == 0  # type: ignore[union-attr]
                finally:
                    daemon.resume()
                wait_until(lambda: daemon.stats()["pinned_chunks"] == 0)
                # another user's chat takes the freed slots
                other.generate([{"role": "user", "content": "Something else entirely. " * 12}])
            return lease

        client.acquire = acquire_then_stall  # type: ignore[union-attr]
        got = engine.generate(history)
        assert stalled and client.lost_leases >= 1  # type: ignore[union-attr]
        assert got.retries >= 1  # the pass whose KV could not be trusted was redone
        assert_same_as_recompute(got, baseline)
    finally:
        engine.close()
        other.close()
        daemon.stop()


@pytest.mark.slow
def test_one_daemon_with_no_model_serves_vllm_and_a_transformers_engine_of_another_model(
        tiny_model_dir, mini_model_dir, tmp_path):
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    saved = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    daemon = Serve(tmp_path, host="1GiB", disk="4GiB").start()
    llm = None
    engine = HFEngine.connect(mini_model_dir, str(daemon.socket), chunk_tokens=16,
                              config=EngineConfig(max_new_tokens=6))
    try:
        ktc = KVTransferConfig(kv_connector="KVTierConnector",
                               kv_connector_module_path="kvtier.engines.vllm", kv_role="kv_both",
                               kv_connector_extra_config={"socket": str(daemon.socket), "chunk_tokens": 64})
        llm = LLM(model=str(tiny_model_dir), dtype="float32", enforce_eager=True, max_model_len=1024,
                  block_size=32, seed=0, enable_prefix_caching=False, kv_transfer_config=ktc)
        sp = SamplingParams(temperature=0.0, max_tokens=8)
        prompt = [6 + (i * 7) % 90 for i in range(300)]
        one = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
        before = daemon.stats()
        turns = converse(engine, QUESTIONS[:2])  # the other model, meanwhile
        two = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
        after = daemon.stats()
        assert list(one.token_ids) == list(two.token_ids)
        assert after["hit_tokens"] - before["hit_tokens"] >= 4 * 64  # vLLM's second request hit
        assert turns[1].got.hit_tokens > 0  # and so did the transformers engine's second turn
        for turn in turns:
            assert_same_as_recompute(turn.got, turn.baseline)
        # same tokens, other model: never each other's chunks
        assert engine.store.lookup(prompt).hit_tokens == 0  # type: ignore[union-attr]
    finally:
        engine.close()
        if llm is not None:
            del llm
            gc.collect()
        daemon.stop()
        os.environ.clear()
        os.environ.update(saved)
