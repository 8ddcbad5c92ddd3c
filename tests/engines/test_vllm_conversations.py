"""Whole conversations through a real vLLM engine with the connector, in vLLM's own defaults
(its prefix cache on) with a pool small enough to preempt and a token budget small enough to
chunk every prefill. Every output must equal vLLM alone's -- a separate engine that never saw
kvtier, run first on the same conversations."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from kvtier.engines.vllm.offline import drain
from kvtier.engines.vllm.worker import WorkerSide

from .test_vllm_connector import BLOCK, CHUNK, Daemon, assert_same, prompt

MAX_TOKENS = 12
POOL_BLOCKS = 32  # five 316-token requests that grow past 320 tokens: vLLM preempts
BUDGET = 96  # tokens a step: a 300-token prompt is prefilled over four steps


def turns(first: list[int], salt: int, n: int, out_of) -> list[list[int]]:
    """The prompts of an ``n``-turn chat: each turn is the history, the reply, new tokens."""
    prompts = [first]
    for t in range(1, n):
        prompts.append(prompts[-1] + list(out_of(prompts[-1]).token_ids) + prompt(40, salt + t))
    return prompts


def make(model_dir: Path, socket: Path | None, events: str | None = None):
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    if socket is None:  # vLLM alone, as plain as it gets
        return LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=960,
                   block_size=BLOCK, seed=0, enable_prefix_caching=False)
    ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.engines.vllm",
                           kv_role="kv_both",
                           kv_connector_extra_config={"socket": str(socket), "retry_s": 0.05, "chunk_tokens": CHUNK,
                                                      "events_poll_ms": 20})
    # vLLM's own KV events publisher (ZMQ), bound to a Unix socket: its GPU blocks' events and
    # kvtier's in one stream
    kec = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events, topic="kv") if events else None
    return LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=960, block_size=BLOCK,
               seed=0, enable_prefix_caching=True, num_gpu_blocks_override=POOL_BLOCKS,
               max_num_batched_tokens=BUDGET, max_num_seqs=4, kv_transfer_config=ktc, kv_events_config=kec)


def run(llm, prompts, salts=None, wait=True):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    inputs = [{"prompt_token_ids": p} | ({"cache_salt": s} if s else {})
              for p, s in zip(prompts, salts or [None] * len(prompts), strict=True)]
    outs = llm.generate(inputs, sp, use_tqdm=False)
    if wait and llm.llm_engine.vllm_config.kv_transfer_config is not None:
        assert drain(llm)
    return outs


CHAT, BATCH = prompt(300, 21), [prompt(316, 30 + i) for i in range(5)]
SHARED = prompt(4 * CHUNK, 40)
AROUND_RESETS = [prompt(230, s) for s in (57, 58, 59)]  # three chunks, then a partial one
PAIR = [SHARED + prompt(100, 41), SHARED + prompt(120, 42)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    saved = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    alone = {"llm": make(tiny_model_dir, None)}
    want: dict[tuple[int, ...], object] = {}

    def ref_out(p):
        key = tuple(p)
        if key not in want:
            want[key] = run(alone["llm"], [p])[0].outputs[0]
        return want[key]

    chat = turns(CHAT, 22, 3, ref_out)
    for p in [*chat, *BATCH, *PAIR, *(prompt(300, s) for s in range(50, 57)), *AROUND_RESETS]:
        ref_out(p)
    alone.clear()  # one engine at a time
    gc.collect()
    tmp = tmp_path_factory.mktemp("conv")
    daemon = Daemon(tmp, tiny_model_dir, host_chunks=64).start()
    llm = make(tiny_model_dir, daemon.socket, events=f"ipc://{tmp / 'kv-events'}")
    ROUTER[:] = [Router(f"ipc://{tmp / 'kv-events'}")]  # subscribed before the first step's events
    try:
        yield llm, daemon, want, chat
    finally:
        del llm
        gc.collect()
        daemon.stop()
        os.environ.clear()
        os.environ.update(saved)


def loaded(daemon) -> int:
    return sum(daemon.stats()["loaded_tokens"].values())


def scheduler_side(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler


def test_the_third_turn_of_a_chat_computes_only_its_new_tokens(stack):
    llm, daemon, want, chat = stack
    for i, p in enumerate(chat):
        llm.reset_prefix_cache()  # vLLM's own cache has forgotten the chat: only kvtier holds it
        before = loaded(daemon)
        out = run(llm, [p])[0]
        assert_same([out.outputs[0]], [want[tuple(p)]])
        if i:
            history = len(chat[i - 1]) + MAX_TOKENS  # the last turn's prompt and reply
            new = len(p) - history
            computed = len(p) - out.num_cached_tokens
            assert computed - new <= BLOCK, (i, computed, new)  # at most one block of history
            assert loaded(daemon) - before == out.num_cached_tokens  # vLLM's count agrees with kvtier's


def test_preempted_and_chunked_prefill_requests_give_vllms_own_output(stack):
    llm, _, want, _ = stack
    side = scheduler_side(llm)
    before = side.preemptions
    outs = run(llm, BATCH)  # together they do not fit in vLLM's pool
    assert side.preemptions > before
    assert_same([o.outputs[0] for o in outs], [want[tuple(p)] for p in BATCH])
    llm.reset_prefix_cache()
    outs = run(llm, BATCH)  # now from kvtier, preempted again
    assert_same([o.outputs[0] for o in outs], [want[tuple(p)] for p in BATCH])
    assert all(o.num_cached_tokens >= 4 * CHUNK for o in outs)


def test_two_requests_sharing_a_prefix_in_one_step(stack):
    llm, _, want, _ = stack
    outs = run(llm, PAIR)
    assert_same([o.outputs[0] for o in outs], [want[tuple(p)] for p in PAIR])
    llm.reset_prefix_cache()
    outs = run(llm, PAIR[::-1])
    assert_same([o.outputs[0] for o in outs], [want[tuple(p)] for p in PAIR[::-1]])
    assert all(o.num_cached_tokens >= 4 * CHUNK for o in outs)


def test_requests_with_another_cache_salt_never_share_chunks(stack):
    llm, daemon, want, _ = stack
    p = prompt(300, 50)
    run(llm, [p], ["alice"])
    llm.reset_prefix_cache()
    before = loaded(daemon)
    out = run(llm, [p], ["bob"])[0]
    assert out.num_cached_tokens == 0 and loaded(daemon) == before  # alice's chunks are not bob's
    assert_same([out.outputs[0]], [want[tuple(p)]])
    llm.reset_prefix_cache()
    out = run(llm, [p], ["alice"])[0]
    assert out.num_cached_tokens >= 4 * CHUNK  # her own are hers


def test_a_copy_that_fails_midway_is_recomputed_with_vllms_own_output(stack, monkeypatch):
    llm, daemon, want, _ = stack
    p = prompt(300, 51)
    run(llm, [p])  # saved
    llm.reset_prefix_cache()
    real, calls = WorkerSide._copy_in, []

    def failing(self, plan):  # the fault: the copy thread dies after its first layer's copies
        calls.append(1)
        copier = self._copier
        real_load = copier.load
        n = [0]

        def load(copy):
            n[0] += 1
            if n[0] > len(plan):
                raise OSError("injected: copy failed")
            real_load(copy)

        copier.load = load
        try:
            real(self, plan)
        finally:
            del copier.load

    monkeypatch.setattr(WorkerSide, "_copy_in", failing)
    before = daemon.stats()["engine_load_failures"]
    out = run(llm, [p])[0]
    monkeypatch.undo()
    assert calls and daemon.stats()["engine_load_failures"] > before
    assert_same([out.outputs[0]], [want[tuple(p)]])
    llm.reset_prefix_cache()
    out = run(llm, [p])[0]  # what the failed step computed was not saved over the good chunks
    assert_same([out.outputs[0]], [want[tuple(p)]])


def test_an_aborted_request_saves_what_it_computed_and_holds_nothing(stack):
    from vllm import SamplingParams

    llm, _, want, _ = stack
    p = prompt(300, 52)
    engine = llm.llm_engine
    engine.add_request("abort-me", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=200))
    for _ in range(8):  # its prefill (four steps) and a few tokens
        engine.step()
    engine.abort_request(["abort-me"])
    assert drain(llm)
    assert scheduler_side(llm).phase("abort-me") is None and not engine.has_unfinished_requests()
    llm.reset_prefix_cache()
    out = run(llm, [p])[0]
    assert out.num_cached_tokens >= 4 * CHUNK + BLOCK  # its prompt, and the tail it had computed
    assert_same([out.outputs[0]], [want[tuple(p)]])


# ------------------------------------------------------------------------------ KV events
class Router:
    """What a KV-aware router knows from vLLM's event stream: decoded with vLLM's own classes."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # keep every event until the test reads them
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.kvtier: dict[object, set[str]] = {}
        """block hash -> the media kvtier holds it in (as its events said)."""
        self.gpu: dict[object, list[int]] = {}
        """block hash -> its tokens (vLLM's own GPU blocks' events)."""
        self.kvtier_tokens: dict[object, list[int]] = {}

    def read(self) -> None:
        import zmq
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        while self.sub.poll(200, zmq.POLLIN):
            _, _, payload = self.sub.recv_multipart()
            for ev in self.decoder.decode(payload).events:
                ours = getattr(ev, "ownership", None) == "kvtier"
                if isinstance(ev, BlockStored):
                    for i, h in enumerate(ev.block_hashes):
                        toks = list(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                        if ours:
                            assert ev.medium not in self.kvtier.get(h, set()), "announced twice"
                            self.kvtier.setdefault(h, set()).add(ev.medium)
                            self.kvtier_tokens[h] = toks
                        else:
                            self.gpu[h] = toks
                elif isinstance(ev, BlockRemoved) and ours:
                    for h in ev.block_hashes:
                        assert ev.medium in self.kvtier.get(h, set()), "removed what was never stored"
                        self.kvtier[h].discard(ev.medium)
                        if not self.kvtier[h]:
                            del self.kvtier[h]


def publish(llm, router: Router) -> None:
    """Let kvtier's poller see the daemon, then run a step (vLLM publishes only after one)."""
    import time

    from vllm import SamplingParams

    time.sleep(0.2)
    skip = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"kvtier": "skip"}})
    llm.generate([{"prompt_token_ids": prompt(8, 99)}], skip, use_tqdm=False)
    router.read()


def truth(llm) -> dict[object, set[str]]:
    """What the daemon holds of the chunks this engine follows, asked of the daemon now."""
    from kvtier.engines.vllm.events import medium_of

    events = scheduler_side(llm).events
    keys = list(events._chunks)
    held: dict[object, set[str]] = {}
    for key, tier in zip(keys, events._probe(keys), strict=True):
        where = medium_of(tier)
        if where is not None:
            for h in events._chunks[key].hashes:
                held.setdefault(h, set()).add(where[0])
    return held


ROUTER: list[Router] = []


@pytest.fixture
def router(stack):
    publish(stack[0], ROUTER[0])  # everything since the engine started
    return ROUTER[0]


def test_kv_events_name_vllms_own_blocks_and_follow_what_the_daemon_holds(stack, router):
    llm, daemon, want, _ = stack
    p = prompt(300, 53)
    out = run(llm, [p])[0]
    assert_same([out.outputs[0]], [want[tuple(p)]])
    publish(llm, router)
    tokens = p + list(out.outputs[0].token_ids)
    saved = (len(p) + MAX_TOKENS - 1) // BLOCK  # its full blocks computed: the chunks and the tail
    blocks_of_p = {h for h, toks in router.kvtier_tokens.items()
                   if any(toks == tokens[i * BLOCK : (i + 1) * BLOCK] for i in range(saved))}
    assert len(blocks_of_p) == saved and all(router.kvtier[h] == {"CPU"} for h in blocks_of_p)
    for h in blocks_of_p:  # the hash vLLM itself published for the GPU block of the same tokens
        assert router.gpu.get(h) == router.kvtier_tokens[h]
    assert router.kvtier == truth(llm)  # every block announced is loadable now, from that tier

    # the daemon restarts: what DRAM held is gone, what SSD kept (write-through) is announced again
    daemon.stop()
    daemon.start()
    publish(llm, router)
    publish(llm, router)
    assert router.kvtier == truth(llm)
    assert all(router.kvtier[h] == {"STORAGE"} for h in blocks_of_p)
    llm.reset_prefix_cache()
    again = run(llm, [p])[0]  # and it is what a router would have sent the request for
    assert again.num_cached_tokens >= saved * BLOCK - BLOCK
    assert_same([again.outputs[0]], [want[tuple(p)]])


def test_after_reset_cache_no_load_comes_from_a_chunk_saved_before(stack, router):
    llm, daemon, want, _ = stack
    p = prompt(300, 54)
    run(llm, [p])
    llm.reset_prefix_cache()
    assert run(llm, [p])[0].num_cached_tokens >= 4 * CHUNK  # from kvtier
    # new weights: vLLM resets its own cache and kvtier's (/reset_prefix_cache?reset_external=true)
    assert llm.reset_prefix_cache(reset_connector=True)
    publish(llm, router)
    assert router.kvtier == {} == truth(llm)  # nothing from before is announced any more
    before = loaded(daemon)
    out = run(llm, [p])[0]
    assert out.num_cached_tokens == 0 and loaded(daemon) == before  # nothing saved before is loaded
    assert_same([out.outputs[0]], [want[tuple(p)]])
    llm.reset_prefix_cache()
    out = run(llm, [p])[0]  # saved anew, under the new epoch
    assert out.num_cached_tokens >= 4 * CHUNK
    assert_same([out.outputs[0]], [want[tuple(p)]])
    publish(llm, router)
    assert router.kvtier and router.kvtier == truth(llm)


def test_a_reset_vllm_could_not_finish_saves_nothing_computed_over_its_old_blocks(stack, router):
    llm, _, want, _ = stack
    side = scheduler_side(llm)
    p = prompt(300, 55)
    run(llm, [p], wait=False)  # its save still holds its blocks: vLLM cannot clear its cache
    assert llm.reset_prefix_cache(reset_connector=True) is False
    assert drain(llm) and side._gpu_stale
    out = run(llm, [p])[0]  # over vLLM's blocks cached before the reset (old weights, say)
    assert out.num_cached_tokens >= 4 * CHUNK
    llm.reset_prefix_cache()
    again = run(llm, [p])[0]
    assert again.num_cached_tokens == 0  # what was computed over them was not saved under the new epoch
    assert_same([again.outputs[0]], [want[tuple(p)]])
    assert llm.reset_prefix_cache(reset_connector=True) and not side._gpu_stale  # retried: it succeeds


def test_a_request_preempted_by_a_reset_is_saved_under_the_new_epoch(stack, router):
    from vllm import SamplingParams

    llm, _, want, _ = stack
    p = prompt(300, 56)
    engine = llm.llm_engine
    engine.add_request("across-reset", {"prompt_token_ids": p},
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1))
    for _ in range(5):  # its prefill (four steps) and a token
        engine.step()
    # new weights while it runs: vLLM preempts it (its KV is recomputed), then resets
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert drain(llm)
    assert_same([outs[0].outputs[0]], [want[tuple(p)]])
    llm.reset_prefix_cache()
    out = run(llm, [p])[0]
    assert out.num_cached_tokens >= 4 * CHUNK  # computed again after the reset, and saved
    assert_same([out.outputs[0]], [want[tuple(p)]])


def test_a_reset_while_a_finished_request_is_saved_succeeds_and_loads_nothing_saved_before(stack, router):
    llm, daemon, want, _ = stack
    core = llm.llm_engine.engine_core.engine_core
    p = AROUND_RESETS[0]
    run(llm, [p], wait=False)
    core.step()  # the save of its tail is begun, and holds its blocks
    assert scheduler_side(llm).counters()[1]["save_backlog_requests"] == 1
    # new weights: vLLM's in-process pause resets at once, and cannot while a block is held
    with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
        core.pause_scheduler(mode="abort", clear_cache=True)
    core.resume_scheduler()
    from kvtier.engines.vllm.offline import reset_cache

    assert reset_cache(llm)  # the save finished first, then vLLM's cache and kvtier's reset
    before = loaded(daemon)
    out = run(llm, [p])[0]
    assert out.num_cached_tokens == 0 and loaded(daemon) == before  # nothing saved before is loaded
    assert_same([out.outputs[0]], [want[tuple(p)]])


def test_saves_planned_before_a_reset_are_never_loaded_after_it(stack, router):
    llm, daemon, want, _ = stack
    core = llm.llm_engine.engine_core.engine_core
    begun, planned = AROUND_RESETS[1:]
    run(llm, [begun], wait=False)
    core.step()  # its tail's slots are reserved; copied and committed at a later step
    saved = daemon.stats()["saved_chunks"]
    assert llm.reset_prefix_cache(reset_connector=True) is False  # vLLM's part waits for the blocks
    assert drain(llm) and daemon.stats()["saved_chunks"] > saved  # committed after the reset...
    run(llm, [planned], wait=False)  # its tail's save planned, not yet begun
    saved = daemon.stats()["saved_chunks"]
    assert llm.reset_prefix_cache(reset_connector=True) is False
    assert drain(llm) and daemon.stats()["saved_chunks"] == saved  # dropped: of no use after it
    from kvtier.engines.vllm.offline import reset_cache

    assert reset_cache(llm)
    for p in (begun, planned):  # ...under the old epoch: never loaded after it
        before = loaded(daemon)
        out = run(llm, [p])[0]
        assert out.num_cached_tokens == 0 and loaded(daemon) == before
        assert_same([out.outputs[0]], [want[tuple(p)]])
