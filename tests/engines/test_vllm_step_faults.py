"""The worker half under faults the daemon or a copy can cause: a daemon slow at every call
(the engine loop waits at most one budget a step), a chunk another writer is writing (never
taken for stored), and copies that raise (every lease ends).

A fake daemon client injects each fault (tests/engines/vllm_fakes.py); the worker is real."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from kvtier.engines.vllm.plan import KVTierMetadata, KVTierWorkerMeta, Transfer, Write

from .vllm_fakes import FakeClient, GatedReserve, key, load, step, worker


class Slow(FakeClient):
    """A daemon that answers every call after ``delay_s``."""

    def __init__(self, delay_s: float, **kw):
        super().__init__(**kw)
        self.delay_s = delay_s
        self.acquired = 0

    def acquire(self, *a, **kw):
        time.sleep(self.delay_s)
        self.acquired += 1
        return super().acquire(*a, **kw)

    def release(self, lease, **report):
        time.sleep(self.delay_s)
        return super().release(lease, **report)

    def reserve(self, *a, **kw):
        time.sleep(self.delay_s)
        return super().reserve(*a, **kw)


def test_a_step_waits_on_a_slow_daemon_one_budget_however_many_loads_it_holds():
    """Five loads whose acquire and release take 0.45 s each: the step waits 1 s in all (its
    budget, ``load_wait_s``), not 1 s a call; what the daemon did not confirm by then is a miss,
    and every lease it granted is released once it comes."""
    client = Slow(0.45)
    w = worker(client)
    w.load_wait_s = 1.0
    loads = [load(f"R{i}", [key(i)], [2 * i, 2 * i + 1]) for i in range(5)]
    waited = w._calls.wait_s
    began = time.monotonic()  # the step, as vLLM's model runner drives it
    w.bind(KVTierMetadata(loads=loads, writes=[Write(t.req_id, t.block_ids, 8, 9) for t in loads]))
    w.start_load_kv()
    for i, kv in enumerate(w.kv):
        w.wait_for_layer_load(f"l{i}")
        w.save_kv_layer(f"l{i}", kv)
    w.wait_for_save()
    errors = w.get_block_ids_with_load_errors()
    took = time.monotonic() - began
    assert w._calls.wait_s - waited <= 1.0 + 0.05  # the loop's own count of its waits
    assert took < 1.0 + 0.5, took  # (generous: copies and thread hand-offs on a busy machine)
    assert errors == set(range(10))  # no load was confirmed intact in time: all recomputed
    deadline = time.monotonic() + 10
    while len(client.released) < 5 and time.monotonic() < deadline:  # (late ones on the calls' thread)
        time.sleep(0.05)
    assert client.acquired == 5 and len(client.released) == 5  # nothing left pinned


def test_a_chunk_another_writer_was_writing_is_planned_again_and_saved_once_it_abandons():
    class Busy(FakeClient):
        """Chunk 1 is being written by someone else the first time it is asked for."""

        def __init__(self):
            super().__init__()
            self.busy = {key(1)}

        def reserve(self, keys, first=0, request=None, tail_tokens=0):
            lease = super().reserve(keys, first, request, tail_tokens)
            for j, k in enumerate(keys):
                if k in self.busy:
                    lease.views[j] = None  # BUSY: no slot, not held
            self.busy.clear()  # the other writer abandons
            return lease

    client = Busy()
    w = worker(client)
    blocks = [0, 1, 2, 3]
    step(w, KVTierMetadata(saves=[Transfer("A", [key(0), key(1)], 0, blocks)], writes=[Write("A", blocks, 0, 16)]))
    assert w.take_meta() == KVTierWorkerMeta({"A": 1})  # chunk 1 is not stored: planned again
    assert w.chunks_busy == 1 and w.saves_skipped == 0
    step(w, KVTierMetadata(saves=[Transfer("A", [key(1)], 1, blocks)], writes=[Write("A", blocks, 16, 17)]))
    assert [keys for _, keys in client.committed] == [[key(0), key(1)], [key(1)]]
    assert set(client.stored) == {key(0), key(1)} and w.take_meta() is None


@pytest.mark.parametrize("inline", [True, False], ids=["copied-inline", "copied-on-a-thread"])
def test_a_finished_requests_busy_chunk_is_asked_for_again_before_its_blocks_go_back(inline):
    class BusyOnce(FakeClient):
        def __init__(self):
            super().__init__()
            self.asked: list[list[bytes]] = []

        def reserve(self, keys, first=0, request=None, tail_tokens=0):
            self.asked.append(list(keys))
            lease = super().reserve(keys, first, request, tail_tokens)
            if len(self.asked) == 1:
                lease.views[0] = None  # chunk 4 is being written by another request
            return lease

    client = BusyOnce()
    w = worker(client, inline)
    fin = Transfer("F", [key(4), key(5)], 0, [0, 1, 2, 3])
    step(w, KVTierMetadata(finishes=[fin]))
    done, deadline = set(), time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        done = w.get_finished(set())[0] or set()
        step(w, KVTierMetadata())
    assert done == {"F"}
    assert client.asked == [[key(4), key(5)], [key(4)]]  # asked again for the busy one only
    assert set(client.stored) == {key(4), key(5)}


def test_a_finished_requests_copy_that_raises_abandons_its_lease_and_lets_the_blocks_go():
    client = FakeClient()
    w = worker(client, inline=False)
    assert w._copier is not None

    def broken(*a, **kw):
        raise RuntimeError("injected: the copy out of vLLM's blocks failed")

    w._copier.save_pages = broken
    step(w, KVTierMetadata(finishes=[Transfer("F", [key(4)], 0, [0, 1])]))
    w._finishing.shutdown(wait=True)  # the save's thread is done
    assert w.get_finished(set())[0] == {"F"}  # vLLM gets its blocks back
    assert client.committed == [] and client.abandoned == ["F"]  # the write lease ended


def test_a_layer_copy_that_raises_never_takes_the_forward_pass_down_and_commits_nothing():
    client = FakeClient()
    w = worker(client)
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("injected")

    w._copier.save_pages = broken
    blocks = [0, 1, 2, 3]
    step(w, KVTierMetadata(saves=[Transfer("A", [key(0), key(1)], 0, blocks)], writes=[Write("A", blocks, 0, 16)]))
    assert calls == [1]  # (the first layer's copy; the others are skipped)
    assert client.committed == [] and client.abandoned == ["A"]
    w._copier.save_pages = type(w._copier).save_pages.__get__(w._copier)
    step(w, KVTierMetadata(saves=[Transfer("B", [key(2)], 0, [4, 5])], writes=[Write("B", [4, 5], 0, 8)]))
    assert client.committed == [("B", [key(2)])]  # what was computed is sound: the next step saves


def test_a_deferred_copy_that_raises_abandons_its_lease():
    client = GatedReserve()
    w = worker(client)
    blocks = [0, 1, 2, 3]
    w.bind(KVTierMetadata(saves=[Transfer("A", [key(1)], 1, blocks)], writes=[Write("A", blocks, 7, 8)]))
    w.start_load_kv()
    for i, kv in enumerate(w.kv):
        w.save_kv_layer(f"l{i}", kv)  # a decode step: the reserve is still out at the first layer
    client.gate.set()

    def broken(*a, **kw):
        raise RuntimeError("injected")

    w._copier.save_pages = broken
    w.wait_for_save()
    w._calls.drain()
    assert client.committed == [] and client.abandoned == ["A"]


def test_a_load_between_steps_whose_copy_raises_waits_for_its_copies_before_the_lease_ends():
    """On an accelerator a copy queued before the failure may still be reading the slot: the
    read lease ends only after the copies are waited for, else the daemon could reuse the slot
    under a copy landing in a block vLLM recomputes."""
    order: list[str] = []

    class Recording(FakeClient):
        def release(self, lease, **report):
            order.append("release")
            return super().release(lease, **report)

    client = Recording()
    w = worker(client)
    copier = w._copier
    real_load, loaded = copier.load_now, []

    def load_now(*a, **kw):
        if loaded:
            raise RuntimeError("injected: the second chunk's copy failed")
        loaded.append(1)
        real_load(*a, **kw)

    copier.load_now = load_now
    copier.sync_now = lambda: order.append("sync")
    t = Transfer("A", [key(0), key(1)], 0, [5, 6, 7, 8], background=True)
    received, errors, deadline = None, set(), time.monotonic() + 10
    plans = iter([KVTierMetadata(loads=[t])])
    while received is None and time.monotonic() < deadline:
        w.bind(next(plans, KVTierMetadata()))
        w.start_load_kv()
        w.wait_for_save()
        _, received = w.get_finished(set())
        errors |= w.get_block_ids_with_load_errors()
    assert received == {"A"} and errors == {5, 6, 7, 8}
    assert order == ["sync", "release"]
    assert client.released[0]["failed"] == 2


def test_finished_requests_behind_a_stalled_daemon_are_let_go_not_waited_for_in_turn(monkeypatch):
    """A pause or a reset waits for finished requests' saves (vLLM holds their blocks): behind a
    stalled daemon they are let go unsaved once it has not answered for a while, not one client
    timeout after the other; a lease that comes later is abandoned."""
    from kvtier.engines.vllm import finished_saves

    monkeypatch.setattr(finished_saves, "STALLED_S", 0.1)

    client = GatedReserve()
    w = worker(client, inline=True)
    fins = [Transfer(f"F{i}", [key(i)], 0, [2 * i, 2 * i + 1]) for i in range(3)]
    step(w, KVTierMetadata(finishes=fins))
    time.sleep(0.2)
    w.bind(KVTierMetadata())
    w.wait_for_save()
    assert w.get_finished(set())[0] == {"F0", "F1", "F2"}  # all let go at once
    client.gate.set()
    deadline = time.monotonic() + 10
    while client.abandoned != ["F0"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.abandoned == ["F0"] and client.committed == []  # the one that was running


def test_finished_requests_saved_on_a_thread_skip_the_daemon_while_it_fails():
    class Away(FakeClient):
        def reserve(self, *a, **kw):
            self.reserved.append(kw.get("request"))
            self.errors += 1  # as StoreClient counts a daemon that did not answer (and answers None)

    client = Away()
    w = worker(client, inline=False)
    step(w, KVTierMetadata(finishes=[Transfer(f"F{i}", [key(i)], 0, [2 * i, 2 * i + 1]) for i in range(3)]))
    w._finishing.shutdown(wait=True)
    assert w.get_finished(set())[0] == {"F0", "F1", "F2"}
    assert client.reserved == ["F0"]  # the others did not wait a timeout each
