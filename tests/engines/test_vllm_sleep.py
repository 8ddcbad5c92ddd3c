"""The vLLM connector's worker half across vLLM's sleep mode (vLLM 0.33+): it drains what
touches vLLM's KV cache, touches it no more while the memory is away, and takes it up again at
wake-up. (vLLM 0.32, installed here, has no sleep hooks: the worker half is driven as 0.33's
``gpu_worker.sleep`` / ``wake_up`` drive the connector.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.engines.vllm.connector import KVTierConnector
from kvtier.engines.vllm.pages import adapter_for
from kvtier.engines.vllm.plan import KVTierMetadata, Transfer, Write
from kvtier.engines.vllm.worker import WorkerSide

from .vllm_fakes import BLOCK, LAYOUT, NUM_BLOCKS, FakeClient, GatedReserve, key, load, step, worker


def finished(w: WorkerSide, rids: set[str], seconds: float = 10) -> set[str]:
    """The requests of ``rids`` reported done within ``seconds`` (vLLM asks every step)."""
    done: set[str] = set()
    deadline = time.monotonic() + seconds
    while done != rids and time.monotonic() < deadline:
        done |= w.get_finished(set())[0] or set()
        time.sleep(0.01)
    return done


def test_asleep_every_load_misses_nothing_is_saved_and_at_wake_up_both_work_again():
    client = FakeClient()
    w = worker(client)
    tensors = list(w.kv)
    w.unregister()
    assert w.asleep and w.kv == [] and not w.enabled  # (no reference to vLLM's KV is used)
    blocks = [0, 1, 2, 3]
    failed = step(w, KVTierMetadata(loads=[load("A", [key(0), key(1)], blocks)],
                                    saves=[Transfer("B", [key(2)], 0, [8, 9])], writes=[Write("B", [8, 9], 0, 8)],
                                    finishes=[Transfer("F", [key(3)], 0, [10, 11])]))
    assert failed == set(blocks)  # recomputed by vLLM
    assert finished(w, {"F"}) == {"F"}  # its blocks go back at once
    assert client.committed == [] and client.released == [] and client.reserved == []
    w.restore()
    assert not w.asleep and w.enabled and all(a is b for a, b in zip(w.kv, tensors, strict=True))
    for kv in w.kv:
        kv[5].fill_(5.0)
    assert step(w, KVTierMetadata(loads=[load("A", [key(0)], [0, 1])],
                                  saves=[Transfer("B", [key(2)], 0, [4, 5])], writes=[Write("B", [4, 5], 0, 8)])) == set()
    assert client.committed == [("B", [key(2)])]
    assert torch.all(client.stored[key(2)].view(torch.float32)[BLOCK * 4 : 2 * BLOCK * 4] == 5.0)


def test_unregister_and_restore_are_idempotent_and_a_disabled_worker_stays_disabled():
    w = worker(FakeClient())
    w.restore()  # (never unregistered: nothing to do)
    w.unregister()
    w.unregister()
    w.restore()
    w.restore()
    assert w.enabled and len(w.kv) == LAYOUT.num_layers
    bad = WorkerSide(FakeClient(), FakeClient(), LAYOUT, BLOCK, adapter_for("FLASH_ATTN"))
    bad.register({f"l{i}": torch.zeros(2, NUM_BLOCKS, BLOCK, 1, 2) for i in range(2)}, NUM_BLOCKS)  # (not a layout vLLM hands over)
    bad.unregister()
    bad.restore()
    assert not bad.enabled


def test_unregister_returns_only_once_a_finished_requests_save_on_its_thread_is_done():
    client = GatedReserve()
    w = worker(client, inline=False)
    for kv in w.kv:
        kv[7].fill_(7.0)
    step(w, KVTierMetadata(finishes=[Transfer("F", [key(4)], 0, [6, 7])]))
    slept = threading.Event()
    sleeper = threading.Thread(target=lambda: (w.unregister(), slept.set()))
    sleeper.start()
    assert not slept.wait(0.3)  # the save is still copying out of vLLM's blocks
    client.gate.set()
    assert slept.wait(10)
    sleeper.join()
    assert client.committed == [("F", [key(4)])]  # copied whole, before the memory went away
    assert torch.all(client.stored[key(4)].view(torch.float32)[BLOCK * 4 : 2 * BLOCK * 4] == 7.0)
    assert finished(w, {"F"}) == {"F"}


def test_a_finished_requests_save_not_begun_is_dropped_and_its_blocks_freed():
    client = GatedReserve()  # its slots are not back when vLLM sleeps
    w = worker(client, inline=True)  # (KV in host memory: copied on the engine's thread)
    step(w, KVTierMetadata(finishes=[Transfer("F", [key(4)], 0, [6, 7])]))
    w.unregister()
    assert finished(w, {"F"}) == {"F"}
    client.gate.set()
    assert w._bg_calls.drain(5)
    assert client.committed == [] and client.abandoned == ["F"]  # the slots came back and went


def test_a_finished_request_waiting_for_the_ranks_verdict_is_dropped_and_a_late_yes_starts_nothing():
    client = FakeClient()
    w = WorkerSide(client, client, LAYOUT, BLOCK, adapter_for("CPU_ATTN"), ranks=2)
    w.register({f"l{i}": torch.zeros(NUM_BLOCKS, 1, BLOCK, 4) for i in range(2)}, NUM_BLOCKS)
    step(w, KVTierMetadata(finishes=[Transfer("F", [key(4)], 0, [6, 7], vote=1)]))  # held for the vote
    w.unregister()
    assert finished(w, {"F"}) == {"F"}
    w.restore()
    step(w, KVTierMetadata(verdicts={1: True}))  # every rank said yes, before the sleep
    assert not finished(w, {"F"}, seconds=0.2) and client.reserved == [] and client.committed == []


def test_a_load_between_steps_queued_when_vllm_sleeps_finishes_first_or_misses():
    client = FakeClient()
    w = worker(client)
    chunk = torch.arange(LAYOUT.chunk_bytes // 4, dtype=torch.float32).view(torch.uint8)
    client.stored = {key(0): chunk.clone()}
    w.bind(KVTierMetadata(loads=[Transfer("A", [key(0)], 0, [5, 6], background=True)]))
    w.start_load_kv()
    w.wait_for_save()
    w.unregister()  # (the load has run by now, or it never touches the KV)
    _, received = w.get_finished(set())
    errors = w.get_block_ids_with_load_errors()
    assert received == {"A"}
    if errors:
        assert errors == {5, 6} and client.released == []
    else:
        w.restore()
        assert torch.equal(w.kv[0][5].flatten(), chunk.view(torch.float32)[: BLOCK * 4])


def test_the_connector_hands_sleep_to_its_worker_half_and_its_scheduler_half_ignores_it():
    w = worker(FakeClient())
    KVTierConnector.unregister_kv_caches(SimpleNamespace(worker=w))
    assert w.asleep
    KVTierConnector.restore_kv_caches(SimpleNamespace(worker=w))
    assert not w.asleep
    KVTierConnector.unregister_kv_caches(SimpleNamespace(worker=None))  # the scheduler's: nothing
    KVTierConnector.restore_kv_caches(SimpleNamespace(worker=None))
