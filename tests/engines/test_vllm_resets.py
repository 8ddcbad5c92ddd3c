"""A cache reset (new weights) in the scheduler half (:mod:`kvtier.engines.vllm.resets`): a
finished request's save planned before it and not yet handed to the workers is dropped, and
vLLM gets the request's blocks back from every rank. Through a real engine, with the resets
vLLM cannot do while a save runs: ``test_vllm_conversations.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier.engines.vllm.plan import KVTierMetadata
from kvtier.engines.vllm.scheduler import SchedulerSide
from kvtier.server.client import StoreClient

from .vllm_fakes import BLOCK, CHUNK, LAYOUT, FakeClient, finished_on_every_rank, ranks, run


def test_a_finish_planned_before_a_reset_is_dropped_and_every_rank_frees_its_blocks(tmp_path):
    client = StoreClient(str(tmp_path / "nobody.sock"), model="m", layout=LAYOUT, page_format="p", retry_s=60)
    sched = SchedulerSide(client, client, BLOCK, ranks=2)
    try:
        blocks = [0, 1, 2, 3, 4]  # two chunks, then a tail of one block
        r = SimpleNamespace(request_id="R", all_token_ids=list(range(2 * CHUNK + BLOCK + 1)), kv_transfer_params=None,
                            cache_salt=None, num_computed_tokens=2 * CHUNK + BLOCK, num_in_flight_tokens=0)
        sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)
        assert sched.request_finished(r, blocks)  # its save holds its blocks
        planned = sched.epoch
        assert sched.reset_cache() and sched.epoch != planned
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
        meta = sched.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={},
            preempted_req_ids=set(), finished_req_ids=set()))
        [finish] = meta.finishes
        assert finish.req_id == "R" and finish.keys == [] and finish.vote > 0  # nothing to save; still voted on

        clients = [FakeClient(), FakeClient()]
        workers = ranks(clients)
        run(workers, sched.tally, meta)
        verdicts = sched.tally.take_verdicts()
        assert verdicts == {finish.vote: True} and not sched.tally.pending
        done = finished_on_every_rank(workers, KVTierMetadata(verdicts=verdicts), {"R"})
        assert done == [{"R"}] * 2 and all(c.committed == [] for c in clients)  # freed, nothing saved
    finally:
        sched.close()
