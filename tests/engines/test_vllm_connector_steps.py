"""The vLLM connector's two halves driven step by step, in the orders vLLM 0.32 calls them.

The worker half gets a fake daemon client only to inject the faults (a load the daemon cannot
complete, a lease lost at release); the scheduler half a real client with no daemon behind it.
The vLLM behaviour imitated: invalid blocks reschedule every request using them from the first
invalid block, vLLM's prefix cache shares a request's blocks with later ones at once, a resumed
request's new block list replaces its old one, async scheduling plans step N+1 before step N's
failures are known, and a step that loads nothing starts its loads after the forward pass. No
chunk computed over KV that never arrived may be stored."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.engines.vllm.pages import adapter_for
from kvtier.engines.vllm.plan import KVTierMetadata, KVTierWorkerMeta, Transfer, Write
from kvtier.engines.vllm.scheduler import SchedulerSide
from kvtier.engines.vllm.worker import WorkerSide
from kvtier.errors import DaemonUnavailable
from kvtier.server.client import StoreClient

from .vllm_fakes import BLOCK, CHUNK, LAYOUT, NUM_BLOCKS, FakeClient, key, load, step, worker


def test_a_request_sharing_a_failed_block_in_the_same_step_saves_nothing_computed_over_it():
    client = FakeClient(give={"A": 1})  # the daemon gives chunk 0 of A's 2 chunks
    w = worker(client)
    shared = [0, 1, 2, 3]  # A loads them; B shares them through vLLM's prefix cache
    failed = step(w, KVTierMetadata(
        loads=[load("A", [key(0), key(1)], shared)],
        saves=[Transfer("B", [key(2)], 2, shared + [4, 5])],
        writes=[Write("A", shared + [10], 16, 17), Write("B", shared + [4, 5], 16, 24)]))
    assert failed == {2, 3}  # vLLM recomputes them
    assert client.committed == []  # B's chunk 2 attended to blocks 2-3


def test_a_step_scheduled_before_a_failure_was_known_saves_nothing_over_it():
    """Async scheduling: step N+1 was planned before step N's failure was known, and a new
    request C found A's blocks in vLLM's prefix cache. Once A has recomputed them, saves of
    what is computed over them are sound again; C's chunk, computed over the bad ones, stays
    suspect."""
    client = FakeClient(give={"A": 1})
    w = worker(client)
    a = [0, 1, 2, 3, 4, 5]
    assert step(w, KVTierMetadata(loads=[load("A", [key(0), key(1)], a[:4])],
                                  writes=[Write("A", a[:5], 16, 17)])) == {2, 3}
    step(w, KVTierMetadata(saves=[Transfer("C", [key(2)], 2, a[:4] + [6, 7])],
                           writes=[Write("A", a[:5], 17, 18), Write("C", a[:4] + [6, 7], 16, 24)]))
    assert client.committed == []
    # vLLM went back: A computes from block 2 (token 8) again
    step(w, KVTierMetadata(saves=[Transfer("A", [key(1), key(2)], 1, a)], writes=[Write("A", a, 8, 24)]),
         loads_after_forward=True)
    assert client.committed == [("A", [key(1), key(2)])]
    step(w, KVTierMetadata(saves=[Transfer("C", [key(3)], 3, a[:4] + [6, 7, 8, 9])],
                           writes=[Write("C", a[:4] + [6, 7, 8, 9], 24, 32)]))
    assert client.committed == [("A", [key(1), key(2)])]  # C attended to its suspect blocks 6-7


def test_a_lease_lost_at_release_is_reported_even_when_vllm_asks_before_wait_for_save():
    client = FakeClient(lose={"A"})
    w = worker(client)
    blocks = [0, 1, 2, 3]
    meta = KVTierMetadata(loads=[load("A", [key(0), key(1)], blocks)],
                          saves=[Transfer("A", [key(2)], 2, blocks + [4, 5])],
                          writes=[Write("A", blocks + [4, 5], 16, 24)])
    assert step(w, meta, errors_first=True) == {0, 1, 2, 3}
    assert client.committed == [] and client.abandoned == ["A"]


def test_a_step_that_raised_leaves_nothing_open_for_the_next():
    client = FakeClient()
    w = worker(client)
    blocks = [0, 1, 2, 3, 4, 5]
    w.bind(KVTierMetadata(loads=[load("A", [key(0), key(1)], blocks[:4])],
                          saves=[Transfer("A", [key(2)], 2, blocks)], writes=[Write("A", blocks, 16, 24)]))
    w.start_load_kv()
    w.save_kv_layer("l0", w.kv[0])  # the forward pass raises here: no wait_for_save
    assert step(w, KVTierMetadata()) == {0, 1, 2, 3}  # the next step ends what it left open
    assert client.abandoned == ["A"] and client.committed == []
    assert client.released[0]["failed"] == 2
    step(w, KVTierMetadata(saves=[Transfer("B", [key(3)], 3, blocks + [6, 7])],
                           writes=[Write("B", blocks + [6, 7], 24, 32)]))
    assert client.committed == []  # B attended to blocks 4-5, computed by the step that raised


def test_a_forward_pass_that_raised_commits_nothing_though_vllm_ends_the_step():
    """vLLM calls wait_for_save in a ``finally``: a step whose forward pass raised after its
    first layer still ends there, and its half-copied chunks must not be committed."""
    client = FakeClient()
    w = worker(client)
    blocks = [0, 1, 2, 3]
    w.bind(KVTierMetadata(saves=[Transfer("A", [key(0), key(1)], 0, blocks)], writes=[Write("A", blocks, 0, 16)]))
    w.start_load_kv()
    w.save_kv_layer("l0", w.kv[0])  # layer 1 never runs
    w.wait_for_save()
    w._calls.drain()
    assert client.committed == [] and client.abandoned == ["A"]
    step(w, KVTierMetadata(saves=[Transfer("B", [key(2)], 2, blocks + [4, 5])], writes=[Write("B", blocks + [4, 5], 16, 24)]))
    assert client.committed == []  # B attended to what the failed step computed


@pytest.mark.parametrize("inline", [True, False], ids=["copied-inline", "copied-on-a-thread"])
def test_only_the_blocks_vllm_lacks_are_loaded_and_counted(inline):
    client = FakeClient()
    w = worker(client, inline)
    chunk = torch.arange(LAYOUT.chunk_bytes // 4, dtype=torch.float32).view(torch.uint8)
    client.stored = {key(0): chunk.clone(), key(1): chunk.clone() + 1}
    # vLLM holds block 0 itself; chunk 1 is a partial chunk of one block (the tail)
    t = load("A", [key(0), key(1)], [20, 21, 22], skip=1, tail=1)
    assert step(w, KVTierMetadata(loads=[t], writes=[Write("A", [20, 21, 22, 23], 12, 13)])) == set()
    pages = chunk.view(torch.float32)
    page = BLOCK * 4  # floats per page (1 head x 4 tokens x 2*dim)
    kv0 = w.kv[0]
    assert torch.equal(kv0[20], torch.zeros_like(kv0[20]))  # vLLM's own block: untouched
    assert torch.equal(kv0[21].flatten(), pages[page : 2 * page])
    assert torch.equal(kv0[22].flatten(), (chunk.clone() + 1).view(torch.float32)[:page])
    layer1 = LAYOUT.layer_bytes // 4
    assert torch.equal(w.kv[1][21].flatten(), pages[layer1 + page : layer1 + 2 * page])
    (report,) = client.released
    assert 0 <= report.pop("wait_s") < 10  # rank 0 logs how long the step waited on its loads
    assert report == {"request": "A", "took": [4, 4], "had": 0, "failed": 0}


def test_a_rank_that_does_not_log_loads_reports_them_without_a_wait():
    """Only rank 0 of an engine (tensor and pipeline) reports its step's wait: the daemon logs a
    request's loads from the release that carries one, so a second rank's would count twice."""
    client = FakeClient()
    w = worker(client, True)
    w.log_loads = False
    chunk = torch.arange(LAYOUT.chunk_bytes // 4, dtype=torch.float32).view(torch.uint8)
    client.stored = {key(0): chunk.clone(), key(1): chunk.clone() + 1}
    t = load("A", [key(0), key(1)], [20, 21, 22], skip=1, tail=1)
    assert step(w, KVTierMetadata(loads=[t], writes=[Write("A", [20, 21, 22, 23], 12, 13)])) == set()
    (report,) = client.released
    assert report.pop("wait_s", None) is None  # (the client sends no wait_ms for None)
    assert report == {"request": "A", "took": [4, 4], "had": 0, "failed": 0}


@pytest.mark.parametrize("inline", [True, False], ids=["copied-inline", "copied-on-a-thread"])
def test_a_finished_request_is_saved_in_the_background_and_reported_done(inline):
    client = FakeClient()
    w = worker(client, inline)
    for kv in w.kv:
        kv[7].fill_(7.0)
    fin = Transfer("F", [key(4), key(5)], 0, [3, 4, 7], tail_blocks=1)
    step(w, KVTierMetadata(finishes=[fin]))
    deadline = time.monotonic() + 10
    done = set()
    while not done and time.monotonic() < deadline:
        done = w.get_finished({"F"})[0] or set()  # (vLLM calls it every step, empty ones too)
        time.sleep(0.01)
    assert done == {"F"}
    assert w._bg_calls.drain(5)
    assert client.committed == [("F", [key(4), key(5)])]
    tail = client.stored[key(5)].view(torch.float32)
    assert torch.all(tail[: BLOCK * 4] == 7.0)  # the tail's one block, at the chunk's start


def test_a_suspect_finished_request_is_reported_done_without_a_save():
    client = FakeClient(give={"A": 1})
    w = worker(client)
    blocks = [0, 1, 2, 3]
    step(w, KVTierMetadata(loads=[load("A", [key(0), key(1)], blocks)], writes=[Write("A", blocks + [4], 16, 17)]))
    step(w, KVTierMetadata(finishes=[Transfer("A", [key(2)], 2, blocks + [4, 5])]))
    assert w.get_finished({"A"}) == ({"A"}, None) and client.committed == []


def test_a_worker_whose_kv_is_not_in_the_named_layout_misses_and_frees_everything():
    client = FakeClient()
    w = WorkerSide(client, client, LAYOUT, BLOCK, adapter_for("FLASH_ATTN"))
    w.register({f"l{i}": torch.zeros(2, NUM_BLOCKS, BLOCK, 1, 2) for i in range(2)}, NUM_BLOCKS)  # (not a layout vLLM hands over)
    assert not w.enabled
    failed = step(w, KVTierMetadata(loads=[load("A", [key(0)], [0, 1])],
                                    finishes=[Transfer("F", [key(1)], 0, [2, 3])]))
    assert failed == {0, 1} and w.get_finished({"F"}) == ({"F"}, None) and client.committed == []


def test_a_load_between_steps_is_reported_received_with_its_failed_blocks_no_later():
    client = FakeClient(give={"A": 1})
    w = worker(client)
    chunk = torch.arange(LAYOUT.chunk_bytes // 4, dtype=torch.float32).view(torch.uint8)
    client.stored = {key(0): chunk.clone()}
    t = Transfer("A", [key(0), key(1)], 0, [5, 6, 7, 8], background=True)
    errors: set[int] = set()
    received = None
    plans = iter([KVTierMetadata(loads=[t])])  # then empty steps, as vLLM runs while A waits
    deadline = time.monotonic() + 10
    while received is None and time.monotonic() < deadline:
        w.bind(next(plans, KVTierMetadata()))
        w.start_load_kv()
        w.wait_for_save()
        _, received = w.get_finished(set())  # vLLM asks for finished transfers first,
        errors |= w.get_block_ids_with_load_errors()  # then for the blocks that failed
        time.sleep(0.01)
    assert received == {"A"} and errors == {7, 8}  # chunk 1 was not given
    assert torch.equal(w.kv[0][5].flatten(), chunk.view(torch.float32)[: BLOCK * 4])
    assert client.released[0]["took"] == [CHUNK]


# -- the scheduler half -------------------------------------------------------------------------

def request(rid, tokens, salt=None):
    return SimpleNamespace(request_id=rid, all_token_ids=list(tokens), kv_transfer_params=None,
                           cache_salt=salt, num_computed_tokens=0, num_in_flight_tokens=0)


def blocks_of(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def output(new=(), cached=None, scheduled=None, preempted=()):
    cached = cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=scheduled or {}, preempted_req_ids=set(preempted),
                           finished_req_ids=set())


@pytest.fixture
def sched(tmp_path):
    client = StoreClient(str(tmp_path / "nobody.sock"), model="m", layout=LAYOUT, page_format="p", retry_s=60)
    s = SchedulerSide(client, client, BLOCK)
    yield s
    s.close()


def test_a_resumed_request_saves_from_its_new_blocks_and_its_reply_too(sched):
    r = request("R", range(4 * CHUNK))
    sched.update_state_after_alloc(r, blocks_of([10, 11, 12, 13]), 0)
    new = SimpleNamespace(req_id="R", block_ids=([10, 11, 12, 13],), num_computed_tokens=0)
    meta = sched.build_connector_meta(output([new], scheduled={"R": 2 * CHUNK}))
    assert [s.block_ids for s in meta.saves] == [[10, 11, 12, 13]]
    # preempted (its blocks freed), then resumed with blocks 30..37, recomputing all
    sched.build_connector_meta(output(preempted=["R"]))
    assert sched.phase("R").value == "preempted"
    sched.update_state_after_alloc(r, blocks_of([]), 0)
    cached = SimpleNamespace(req_ids=["R"], resumed_req_ids={"R"}, new_block_ids=[([30, 31, 32, 33, 34, 35, 36, 37],)],
                             num_computed_tokens=[0])
    save = sched.build_connector_meta(output(cached=cached, scheduled={"R": 4 * CHUNK})).saves[0]
    # all of it again, from its new blocks (chunks the daemon holds already are not copied)
    assert (save.first_chunk, save.block_ids) == (0, [30, 31, 32, 33, 34, 35, 36, 37])
    assert save.keys[:2] == meta.saves[0].keys
    # it generates: its 5th chunk is saved by the step that computes its last token
    r.all_token_ids += list(range(100, 100 + CHUNK))
    cached = SimpleNamespace(req_ids=["R"], resumed_req_ids=set(), new_block_ids=[([38, 39],)],
                             num_computed_tokens=[5 * CHUNK - 1])
    save = sched.build_connector_meta(output(cached=cached, scheduled={"R": 1})).saves[0]
    assert (save.first_chunk, len(save.keys)) == (4, 1)
    # finished after BLOCK + 1 more tokens (the last one sampled, never computed): its full
    # chunks are all saved; its tail of one block is, when vLLM frees the request
    r.all_token_ids += list(range(200, 200 + BLOCK + 1))
    r.num_computed_tokens = 5 * CHUNK + BLOCK
    assert sched.request_finished(r, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40])
    fin = sched.build_connector_meta(output()).finishes[0]
    assert (fin.first_chunk, fin.tail_blocks, len(fin.keys), fin.block_ids[-1]) == (5, 1, 1, 40)


def test_a_cache_salt_gives_other_keys(sched):
    tokens = list(range(3 * CHUNK))
    plain = sched._full_keys(request("a", tokens), tokens)
    salted = sched._full_keys(request("b", tokens, salt="tenant-1"), tokens)
    other = sched._full_keys(request("c", tokens, salt="tenant-2"), tokens)
    assert len({plain[0], salted[0], other[0]}) == 3 and len({plain[2], salted[2], other[2]}) == 3


def test_a_lora_adapter_and_an_image_give_other_keys_and_prompt_embeds_skip(sched):
    from kvtier.engines.vllm.request_state import skipped

    tokens = list(range(3 * CHUNK))
    base = sched._full_keys(request("a", tokens), tokens)
    lora = request("b", tokens)
    lora.lora_request = SimpleNamespace(lora_name="adapter-1")
    assert sched._full_keys(lora, tokens)[0] != base[0]

    def with_image(name):
        r = request("c", tokens)
        r.mm_features = [SimpleNamespace(mm_position=SimpleNamespace(offset=CHUNK + 2, length=4), identifier=name)]
        return sched._full_keys(r, tokens)

    one, other = with_image("img-a"), with_image("img-b")
    assert one[0] == base[0] and one[1] != base[1] and one[1] != other[1]  # from the image's chunk on
    embeds = request("d", tokens)
    embeds.prompt_embeds = torch.zeros(3, 2)
    assert skipped(embeds) and sched.get_num_new_matched_tokens(embeds, 0) == (0, False)


def test_adapters_are_told_apart_by_path_and_fields_never_run_together(sched):
    tokens = list(range(3 * CHUNK))

    def keys(salt=None, name=None, path=None):
        r = request("r", tokens, salt=salt)
        if name is not None:
            r.lora_request = SimpleNamespace(lora_name=name, lora_path=path)
        return sched._full_keys(r, tokens)[0]

    assert keys(name="a", path="/v1") != keys(name="a", path="/v2")  # re-pointed adapter
    assert keys(salt="xlora:foo") != keys(salt="x", name="foo", path="")


def test_a_partial_chunk_key_names_only_the_images_within_it(sched):
    tokens = list(range(2 * CHUNK))
    plain, later = request("a", tokens), request("b", tokens)
    later.mm_features = [SimpleNamespace(mm_position=SimpleNamespace(offset=CHUNK + BLOCK, length=2), identifier="i")]
    keys = sched._full_keys(plain, tokens[:CHUNK])
    # the partial chunk of one block of chunk 1 ends before the image: same key either way
    assert sched._tail_key(plain, keys, tokens, 1, 1) == sched._tail_key(later, keys, tokens, 1, 1)


def test_a_request_whose_load_failed_is_not_offered_kvtier_again_and_saves_what_it_redoes(sched, monkeypatch):
    monkeypatch.setattr(sched.client, "lookup_keys", lambda keys, **kw: ["host"] * len(keys))
    r = request("R", range(4 * CHUNK + 1))
    assert sched.get_num_new_matched_tokens(r, 0)[0] == 4 * CHUNK
    sched.update_state_after_alloc(r, blocks_of(range(20, 29)), 4 * CHUNK)
    sched.build_connector_meta(output())
    sched.update_connector_output(SimpleNamespace(invalid_block_ids={22}, finished_recving=set()))
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)  # vLLM asks again: computed
    # vLLM truncated it to chunk 1 and schedules it as new: chunks 1-3 are saved once redone
    new = SimpleNamespace(req_id="R", block_ids=(list(range(20, 29)),), num_computed_tokens=CHUNK)
    meta = sched.build_connector_meta(output([new], scheduled={"R": 3 * CHUNK}))
    assert [(t.first_chunk, len(t.keys)) for t in meta.saves] == [(1, 3)]


def test_a_lookup_has_no_side_effects_and_a_daemon_away_is_a_miss(sched):
    r = request("R", range(3 * CHUNK))
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.phase("R") is None  # nothing tracked until vLLM allocates


def test_a_waiting_request_asked_about_every_step_is_looked_up_once_a_second(sched, monkeypatch):
    from kvtier.engines.vllm import lookups

    calls = []
    monkeypatch.setattr(sched.client, "lookup_keys", lambda keys, **kw: calls.append(1) or [])
    r = request("R", range(3 * CHUNK))
    for _ in range(50):  # vLLM's scheduler, while the request waits for blocks
        sched.get_num_new_matched_tokens(r, 0)
    assert len(calls) == 1
    sched.get_num_new_matched_tokens(r, BLOCK)  # vLLM found a block itself: the answer serves
    assert len(calls) == 1
    sched.get_num_new_matched_tokens(r, 0)  # vLLM lost it again: asked anew (its tail may differ)
    sched.get_num_new_matched_tokens(r, BLOCK)
    assert len(calls) == 2
    monkeypatch.setattr(lookups, "LOOKUP_REUSE_S", 0.0)
    gate = threading.Event()
    monkeypatch.setattr(sched.client, "lookup_keys", lambda keys, **kw: gate.wait(5) and calls.append(1) or [])
    waits = sched._calls.waits
    assert sched.get_num_new_matched_tokens(r, BLOCK) == (0, False)  # the last answer, at once:
    assert sched._calls.waits == waits  # the refresh runs in the background, never waited for
    gate.set()
    assert sched._calls.drain(5)
    assert len(calls) == 3


class SlowReserve(FakeClient):
    """Reserves wait for ``gate``; every call is logged in order."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()
        self.calls: list[str] = []

    def acquire(self, keys, **kw):
        self.calls.append("acquire")
        return super().acquire(keys, **kw)

    def reserve(self, keys, **kw):
        self.calls.append("reserve")
        self.gate.wait(5)
        return super().reserve(keys, **kw)


def test_a_decode_step_never_waits_for_its_save_at_the_first_layer_and_copies_it_after_the_pass():
    client = SlowReserve()
    w = worker(client)
    blocks = [0, 1, 2, 3]
    for i, kv in enumerate(w.kv):
        for b in blocks:
            kv[b].fill_(float(10 * i + b + 1))
    # a decode step completing chunk 1 of A
    w.bind(KVTierMetadata(saves=[Transfer("A", [key(1)], 1, blocks)], writes=[Write("A", blocks, 7, 8)]))
    w.start_load_kv()
    waits = w._calls.waits
    for i, kv in enumerate(w.kv):
        w.wait_for_layer_load(f"l{i}")
        w.save_kv_layer(f"l{i}", kv)
    assert w._calls.waits == waits  # the reserve is still out: the pass did not wait for it
    client.gate.set()  # it comes back while the forward pass ends
    w.wait_for_save()
    w._calls.drain()
    assert client.committed == [("A", [key(1)])]
    stored = client.stored[key(1)].view(torch.float32)
    n = LAYOUT.layer_bytes // 4
    assert torch.all(stored[: n // 2] == 3.0) and torch.all(stored[n // 2 : n] == 4.0)  # layer 0: blocks 2, 3
    assert torch.all(stored[n : n + n // 2] == 13.0)  # layer 1, from vLLM's blocks after the pass
    assert w.take_meta() is None


def test_a_save_not_reserved_by_the_end_of_its_step_is_planned_again_and_its_lease_abandoned():
    client = SlowReserve()
    w = worker(client)
    w.wait_s = 0.01
    blocks = [0, 1, 2, 3]
    step(w, KVTierMetadata(saves=[Transfer("A", [key(1)], 1, blocks)], writes=[Write("A", blocks, 7, 8)]))
    assert w.take_meta() == KVTierWorkerMeta({"A": 1})  # the scheduler plans it again
    client.gate.set()
    deadline = time.monotonic() + 5
    while not client.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.committed == [] and client.abandoned == ["A"]  # the late lease is ended


def test_a_step_that_loads_sends_its_reserves_after_its_acquires():
    client = SlowReserve()
    client.gate.set()
    w = worker(client)
    client.stored = {key(0): torch.zeros(LAYOUT.chunk_bytes, dtype=torch.uint8)}
    step(w, KVTierMetadata(loads=[load("B", [key(0)], [8, 9])],
                           saves=[Transfer("A", [key(1)], 1, [0, 1, 2, 3])],
                           writes=[Write("B", [8, 9], 8, 9), Write("A", [0, 1, 2, 3], 7, 8)]))
    assert client.calls == ["acquire", "reserve"]
    assert client.committed == [("A", [key(1)])]


def test_a_refresh_that_fails_at_once_keeps_the_answer_and_one_that_hangs_is_a_miss(sched, monkeypatch):
    from kvtier.engines.vllm import lookups

    monkeypatch.setattr(sched.client, "lookup_keys", lambda keys, **kw: ["host"] * len(keys))
    r = request("R", range(2 * CHUNK + 1))
    assert sched.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, False)
    monkeypatch.setattr(lookups, "LOOKUP_REUSE_S", 0.0)

    def fail(keys, **kw):
        raise DaemonUnavailable("gone")

    monkeypatch.setattr(sched.client, "lookup_keys", fail)
    sched._lookups["R"].at = time.monotonic()
    assert sched.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, False)  # the refresh goes out
    assert sched._calls.drain(5)
    monkeypatch.setattr(lookups, "LOOKUP_REUSE_S", 10.0)  # (the answer is still young)
    assert sched.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, False)  # it failed: the answer stands
    gate = threading.Event()
    monkeypatch.setattr(sched.client, "lookup_keys", lambda keys, **kw: gate.wait(5) and [])
    monkeypatch.setattr(lookups, "LOOKUP_REUSE_S", 0.0)
    sched.lookup_deadline_s = 0.05
    assert sched.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, False)  # a refresh, hanging
    time.sleep(0.1)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)  # past its deadline: a miss
    gate.set()


def test_pending_block_frees_buy_one_step_per_finished_request_and_end_with_its_save(sched, monkeypatch):
    from kvtier.engines.vllm import scheduler

    assert not sched.has_pending_block_frees()
    r = request("R", range(CHUNK + BLOCK))
    sched.update_state_after_alloc(r, blocks_of(range(10, 13)), 0)
    new = SimpleNamespace(req_id="R", block_ids=(list(range(10, 13)),), num_computed_tokens=0)
    sched.build_connector_meta(output([new], scheduled={"R": CHUNK + BLOCK}))
    r.num_computed_tokens = CHUNK + BLOCK
    assert sched.request_finished(r, list(range(10, 13)))  # its tail is saved: blocks kept
    assert sched.has_pending_block_frees()  # vLLM waits for them once instead of preempting
    assert not sched.has_pending_block_frees()  # and not again for the same finish
    sched.update_connector_output(SimpleNamespace(finished_sending={"R"}, finished_recving=set(),
                                                  invalid_block_ids=set()))
    assert not sched._freeing
    r2 = request("S", range(CHUNK + BLOCK))
    sched.update_state_after_alloc(r2, blocks_of(range(20, 23)), 0)
    new = SimpleNamespace(req_id="S", block_ids=(list(range(20, 23)),), num_computed_tokens=0)
    sched.build_connector_meta(output([new], scheduled={"S": CHUNK + BLOCK}))
    r2.num_computed_tokens = CHUNK + BLOCK
    assert sched.request_finished(r2, list(range(20, 23)))
    monkeypatch.setattr(scheduler, "PENDING_FREE_S", 0.0)  # a save slower than that: vLLM preempts
    assert not sched.has_pending_block_frees()


def busy_with_gated_lookups(sched, monkeypatch, gate: threading.Event, gate_s: float) -> list[int]:
    """A request runs; every lookup holds until ``gate`` opens (at most ``gate_s``), then finds
    all its chunks in DRAM; the number of keys of each lookup made."""
    asked: list[int] = []

    def lookup(keys, **kw):
        asked.append(len(keys))
        gate.wait(gate_s)
        return ["host"] * len(keys)

    monkeypatch.setattr(sched.client, "lookup_keys", lookup)
    monkeypatch.setattr(sched.client, "probe", lambda keys, **kw: [None] * len(keys))
    busy = SimpleNamespace(req_id="B", block_ids=([1],), num_computed_tokens=0)
    sched.build_connector_meta(output([busy], scheduled={"B": 1}))  # a request runs
    return asked


def test_a_request_is_looked_up_on_arrival_and_a_running_batch_never_waits_for_it(sched, monkeypatch):
    gate = threading.Event()
    asked = busy_with_gated_lookups(sched, monkeypatch, gate, 5)
    r = request("R", range(3 * CHUNK + 1))
    sched.on_new_request(r)  # vLLM's add_request: the lookup goes out now, for no local tokens
    waits = sched._calls.waits
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)  # not back: the request waits a step
    assert sched._calls.waits == waits  # and the running batch did not wait for the daemon at all
    gate.set()
    assert sched._calls.drain(5)
    assert asked == [3]  # one lookup, the arrival's
    # vLLM's own prefix cache now has a chunk of it: the arrival's answer serves, for the rest
    assert sched.get_num_new_matched_tokens(r, CHUNK) == (2 * CHUNK, False)
    assert asked == [3] and sched._calls.waits == waits
    sched.update_state_after_alloc(r, blocks_of(range(10, 17)), 2 * CHUNK)
    load = sched.build_connector_meta(output()).loads[0]
    assert (load.first_chunk, load.skip_blocks, len(load.keys)) == (1, 2, 2)  # chunks 1-2 only


def test_a_request_waiting_at_the_queues_head_has_its_ssd_chunks_promoted_once(sched, monkeypatch):
    monkeypatch.setattr(sched.client, "lookup_keys", lambda keys, **kw: ["host", "disk"][: len(keys)])
    monkeypatch.setattr(sched.client, "probe", lambda keys, **kw: [None] * len(keys))
    promoted: list[list[bytes]] = []
    monkeypatch.setattr(sched._hint_client, "prefetch", lambda keys, **kw: promoted.append(list(keys)) or 0)
    monkeypatch.setattr(sched._hint_client, "queued", lambda *a, **kw: 0)
    r = request("R", range(2 * CHUNK + 1))
    while (first := sched.get_num_new_matched_tokens(r, 0))[0] is None:  # (a slow machine)
        time.sleep(0.01)
    assert first == (2 * CHUNK, False)
    sched._hints.submit(lambda: None).result(5)
    assert promoted == []  # scheduled at once, perhaps: its acquire promotes what it needs
    for _ in range(5):  # asked again and again: it waits for blocks at the queue's head
        assert sched.get_num_new_matched_tokens(r, 0) == (2 * CHUNK, False)
    sched._hints.submit(lambda: None).result(5)
    assert promoted == [sched._lookups["R"].keys]  # once, with the chunk on SSD in it
    only_host = request("H", range(2 * CHUNK + 1))
    monkeypatch.setattr(sched.client, "lookup_keys", lambda keys, **kw: ["host"] * len(keys))
    for _ in range(3):
        sched.get_num_new_matched_tokens(only_host, 0)
    sched._hints.submit(lambda: None).result(5)
    assert len(promoted) == 1  # all of it in DRAM already: nothing to promote


class Pool:
    """vLLM's block pool as the connector sees it: its free blocks."""

    def __init__(self, free: int) -> None:
        self.free = free

    def get_num_free_blocks(self) -> int:
        return self.free


def test_a_running_batch_waits_briefly_only_for_a_request_its_pool_has_room_for(sched, monkeypatch):
    from kvtier.engines.vllm import lookups

    monkeypatch.setattr(lookups, "ROOM_WAIT_S", 5.0)  # (a slow machine: the bound is not the point)
    busy_with_gated_lookups(sched, monkeypatch, threading.Event(), 0.2)
    r = request("R", range(3 * CHUNK + 1))
    need = -(-len(r.all_token_ids) // BLOCK)
    sched.block_pool = Pool(need - 1)  # no room: vLLM could not admit it this step
    sched.on_new_request(r)
    waits = sched._calls.waits
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)
    assert sched._calls.waits == waits  # the decode step did not wait
    sched.block_pool = Pool(need)  # room now: the step admits it, so its answer is worth a wait
    other = request("S", range(1000, 1000 + 3 * CHUNK + 1))
    sched.on_new_request(other)
    assert sched.get_num_new_matched_tokens(other, 0) == (3 * CHUNK, False)  # this very step
    assert sched._calls.waits == waits + 1
    sched.block_pool = None  # a vLLM that binds no pool: never a wait while requests run
    third = request("T", range(2000, 2000 + 3 * CHUNK + 1))
    sched.on_new_request(third)
    assert sched.get_num_new_matched_tokens(third, 0) == (None, False)
    assert sched._calls.waits == waits + 1


def test_an_answer_from_arrival_that_queued_long_is_served_refreshed_and_promoted(sched, monkeypatch):
    from kvtier.engines.vllm import lookups

    asked: list[int] = []
    monkeypatch.setattr(sched.client, "lookup_keys", lambda keys, **kw: asked.append(len(keys)) or ["disk"] * len(keys))
    monkeypatch.setattr(sched.client, "probe", lambda keys, **kw: [None] * len(keys))
    promoted: list[tuple[int, int, str | None]] = []
    monkeypatch.setattr(sched._hint_client, "prefetch",
                        lambda keys, **kw: promoted.append((len(keys), kw.get("first"), kw.get("request"))) or 0)
    monkeypatch.setattr(sched._hint_client, "queued", lambda *a, **kw: 0)
    r = request("R", range(3 * CHUNK + 1))
    sched.on_new_request(r)
    assert sched._calls.drain(5) and asked == [3]
    monkeypatch.setattr(lookups, "LOOKUP_REUSE_S", 0.0)  # it has queued since it arrived
    # vLLM holds its first chunk itself: the answer serves the rest at once
    assert sched.get_num_new_matched_tokens(r, CHUNK) == (2 * CHUNK, False)
    assert sched._calls.drain(5) and asked == [3, 3]  # and is refreshed in the background
    sched._hints.submit(lambda: None).result(5)
    assert promoted == [(2, 1, "R")]  # only the chunks vLLM lacks, under the request's use
