"""The ranks of a multi-rank engine (tensor x pipeline parallel) commit a save only once every
rank voted for it (:mod:`kvtier.engines.vllm.votes`).

Each rank's worker half is driven as vLLM drives it, with its own fake daemon client (a fake
only to inject a failed load on one rank); the workers' metadata is merged as vLLM's
``KVOutputAggregator`` merges it, and counted by the scheduler half's ``Tally``; the verdicts
ride the next step's metadata, as the scheduler half sends them. Pipeline stages run one after
the other here, as a pipeline runs them: no rank waits for another inside a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.engines.vllm import votes
from kvtier.engines.vllm.pages import adapter_for
from kvtier.engines.vllm.plan import KVTierMetadata, KVTierWorkerMeta, Transfer, Write
from kvtier.engines.vllm.scheduler import SchedulerSide
from kvtier.engines.vllm.votes import Tally
from kvtier.engines.vllm.worker import WorkerSide
from kvtier.server.client import StoreClient

from .vllm_fakes import (
    BLOCK,
    CHUNK,
    LAYOUT,
    NUM_BLOCKS,
    FakeClient,
    finished_on_every_rank,
    key,
    load,
    ranks,
    run,
    step,
)

A = [0, 1, 2, 3]  # request A's blocks: chunk 0 loaded (blocks 0-1), chunk 1 computed (blocks 2-3)


def a_step(tally: Tally) -> KVTierMetadata:
    return KVTierMetadata(loads=[load("A", [key(0)], A[:2])],
                          saves=[Transfer("A", [key(1)], 1, A, vote=tally.ballot())],
                          writes=[Write("A", A, CHUNK, 2 * CHUNK)])


def test_a_pipeline_stage_never_commits_what_it_computed_over_another_stages_failed_load():
    """Stage 0 could not load chunk 0 (its blocks are recomputed); stage 1 could. What stage 1
    computed for chunk 1 came from stage 0's hidden states over the blocks that never arrived:
    neither stage may commit chunk 1 (a lookup would find stage 0's shard missing, or worse,
    stage 1's wrong one beside a right one)."""
    clients = [FakeClient(give={"A": 0}), FakeClient()]
    workers, tally = ranks(clients), Tally(2)
    errors = run(workers, tally, a_step(tally))
    assert errors == {0: {0, 1}, 1: set()}
    assert all(c.committed == [] for c in clients)  # held for the verdict
    verdicts = tally.take_verdicts()
    assert verdicts == {1: False} and tally.vetoed == 1 and not tally.pending
    run(workers, tally, KVTierMetadata(verdicts=verdicts))
    assert all(c.committed == [] for c in clients)
    assert clients[1].abandoned == ["A"] and clients[0].abandoned == ["A"]


def test_tensor_and_pipeline_ranks_commit_only_once_all_voted_yes():
    clients = [FakeClient() for _ in range(4)]  # TP 2 x PP 2
    workers, tally = ranks(clients), Tally(4)
    run(workers, tally, a_step(tally))
    assert all(c.committed == [] for c in clients)
    assert tally.pending  # the verdict is owed: vLLM must step to deliver it
    run(workers, tally, KVTierMetadata(verdicts=tally.take_verdicts()))
    assert all(c.committed == [("A", [key(1)])] for c in clients) and not tally.pending


def test_one_rank_whose_lease_did_not_come_vetoes_everyone():
    class NoRoom(FakeClient):
        def reserve(self, keys, first=0, request=None, tail_tokens=0):
            return None  # the daemon is away, or DRAM is full of pins
    clients = [FakeClient(), NoRoom()]
    workers, tally = ranks(clients), Tally(2)
    run(workers, tally, a_step(tally))
    run(workers, tally, KVTierMetadata(verdicts=tally.take_verdicts()))
    assert clients[0].committed == [] and clients[0].abandoned == ["A"]


def test_a_finished_requests_save_starts_only_on_a_yes():
    """A finished request's blocks are kept until its save is done: no rank saves it before
    every rank said yes, and one that some rank found suspect is let go unsaved everywhere."""

    clients = [FakeClient(), FakeClient(give={"B": 0})]
    workers, tally = ranks(clients), Tally(2)
    fin_a = Transfer("A", [key(4)], 0, [8, 9], vote=tally.ballot())
    fin_b = Transfer("B", [key(5)], 0, [10, 11], vote=tally.ballot())
    # rank 1 could not load B's chunk 0 in the step that saw B finish: B's KV is suspect there
    run(workers, tally, KVTierMetadata(loads=[load("B", [key(6)], [10, 11])], finishes=[fin_a, fin_b]))
    assert workers[0].get_finished(set()) == (None, None)  # rank 0 waits for the verdict
    assert all(c.reserved == [] for c in clients)
    verdicts = tally.take_verdicts()
    assert verdicts == {fin_a.vote: True, fin_b.vote: False}
    assert finished_on_every_rank(workers, KVTierMetadata(verdicts=verdicts), {"A", "B"}) == [{"A", "B"}] * 2
    assert all(c.committed == [("A", [key(4)])] for c in clients)


def test_a_rank_that_hears_no_verdict_abandons_what_it_holds(monkeypatch):
    monkeypatch.setattr(votes, "VERDICT_WAIT_S", 0.0)
    client = FakeClient()
    w = ranks([client, FakeClient()])[0]
    tally = Tally(2)
    step(w, a_step(tally))  # the other rank's vote never comes
    step(w, KVTierMetadata())
    assert client.committed == [] and client.abandoned == ["A"]


def test_the_scheduler_gives_ballots_and_keeps_vllm_stepping_until_the_verdicts_are_out(tmp_path):
    client = StoreClient(str(tmp_path / "nobody.sock"), model="m", layout=LAYOUT, page_format="p", retry_s=60)
    sched = SchedulerSide(client, client, BLOCK, ranks=2)
    try:
        r = SimpleNamespace(request_id="R", all_token_ids=list(range(2 * CHUNK)), kv_transfer_params=None,
                            cache_salt=None, num_computed_tokens=0, num_in_flight_tokens=0)
        sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3],)), 0)
        new = SimpleNamespace(req_id="R", block_ids=([0, 1, 2, 3],), num_computed_tokens=0)
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
        meta = sched.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={"R": 2 * CHUNK},
            preempted_req_ids=set(), finished_req_ids=set()))
        ballots = [s.vote for s in meta.saves]
        assert ballots and all(b > 0 for b in ballots) and sched.has_pending_push_work()
        half = KVTierWorkerMeta(votes={b: (1, True) for b in ballots})
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=half.aggregate(half)))
        empty = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={},
                                preempted_req_ids=set(), finished_req_ids=set())
        assert sched.build_connector_meta(empty).verdicts == dict.fromkeys(ballots, True)
        assert not sched.has_pending_push_work()
        assert sched.build_connector_meta(empty).verdicts == {}  # each sent once
    finally:
        sched.close()


def test_one_rank_votes_on_nothing_and_commits_at_the_end_of_its_step():
    client = FakeClient()
    w = WorkerSide(client, client, LAYOUT, BLOCK, adapter_for("CPU_ATTN"))
    w.register({f"l{i}": torch.zeros(NUM_BLOCKS, 1, BLOCK, 4) for i in range(LAYOUT.num_layers)}, NUM_BLOCKS)
    tally = Tally(1)
    step(w, a_step(tally))
    assert client.committed == [("A", [key(1)])] and w.take_meta() is None and not tally.pending


def test_an_executor_where_each_rank_schedules_alone_is_refused_for_several_ranks(monkeypatch):
    from vllm.distributed import parallel_state

    from kvtier.engines.vllm.votes import check_executor, engine_ranks

    with pytest.raises(ValueError, match="external_launcher.*cannot agree"):
        check_executor(SimpleNamespace(distributed_executor_backend="external_launcher"), 2)
    check_executor(SimpleNamespace(distributed_executor_backend="external_launcher"), 1)
    check_executor(SimpleNamespace(distributed_executor_backend="mp"), 4)

    def not_set_up():
        raise AssertionError("tensor model parallel group is not initialized")

    # a worker that cannot tell its rank in a 2-rank engine
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", not_set_up)
    with pytest.raises(ValueError, match="cannot tell its own rank"):
        engine_ranks(True, 2)
    assert engine_ranks(True, 1) == (0, 0)


def test_a_save_skipped_in_the_step_that_finishes_its_request_joins_the_requests_finish(tmp_path):
    """vLLM hands the scheduler a finished request (``request_finished``) before that step's
    worker output: a save the step skipped (the daemon slow, a chunk another writer held) is
    then added to the finish, whose blocks vLLM keeps, rather than lost."""
    client = StoreClient(str(tmp_path / "nobody.sock"), model="m", layout=LAYOUT, page_format="p", retry_s=60)
    sched = SchedulerSide(client, client, BLOCK)
    try:
        tokens = list(range(2 * CHUNK + BLOCK))
        r = SimpleNamespace(request_id="R", all_token_ids=tokens, kv_transfer_params=None, cache_salt=None,
                            num_computed_tokens=0, num_in_flight_tokens=0)
        blocks = list(range(5))
        sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)
        new = SimpleNamespace(req_id="R", block_ids=(blocks,), num_computed_tokens=0)
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
        meta = sched.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={"R": len(tokens)},
            preempted_req_ids=set(), finished_req_ids=set()))
        assert [(s.first_chunk, len(s.keys)) for s in meta.saves] == [(0, 2)]
        r.num_computed_tokens = len(tokens)
        assert sched.request_finished(r, blocks)  # its tail block: a finish from chunk 2
        # then the step's output: the worker could not store chunk 1
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVTierWorkerMeta({"R": 1})))
        empty = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={},
                                preempted_req_ids=set(), finished_req_ids=set())
        (fin,) = sched.build_connector_meta(empty).finishes
        assert fin.first_chunk == 1 and fin.keys == [meta.saves[0].keys[1], fin.keys[1]] and fin.tail_blocks == 1
    finally:
        sched.close()
