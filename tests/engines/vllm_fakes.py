"""What the step-by-step tests of the vLLM connector's worker half share: a fake daemon client
(a fake only to inject faults -- a load the daemon cannot complete, a lease lost at release, a
chunk another writer holds), a worker over CPU-layout KV, and one step driven as vLLM's model
runner drives it."""

from __future__ import annotations

import threading
import time

import torch

from kvtier.core.layout import KVLayout
from kvtier.engines.vllm.pages import adapter_for
from kvtier.engines.vllm.plan import KVTierMetadata, Transfer
from kvtier.engines.vllm.votes import Tally
from kvtier.engines.vllm.worker import WorkerSide

BLOCK = 4
CHUNK = 8  # 2 blocks a chunk
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32", chunk_tokens=CHUNK)
NUM_BLOCKS = 64


def key(i: int) -> bytes:
    return bytes([i]) * 16


class FakeLease:
    def __init__(self, keys, views, request):
        self.keys, self.views, self.request = list(keys), views, request
        self.held = [False] * len(views)


class FakeClient:
    """Acquire gives ``give[request]`` chunks of a load (default all), filled with ``fill``;
    release reports the lease intact unless the request is in ``lose``."""

    def __init__(self, give=None, lose=()):
        self.give, self.lose = give or {}, set(lose)
        self.committed: list[tuple[str, list[bytes]]] = []
        self.abandoned: list[str] = []
        self.released: list[dict] = []
        self.reserved: list[str] = []
        self.errors = 0
        self.stored: dict[bytes, torch.Tensor] = {}

    @staticmethod
    def sizes(keys, tail_tokens):
        sizes = [LAYOUT.chunk_bytes] * len(keys)
        if tail_tokens:
            sizes[-1] = LAYOUT.part_bytes(tail_tokens)  # a partial chunk is its own size
        return sizes

    def acquire(self, keys, first=0, request=None, tail_tokens=0):
        n = self.give.get(request, len(keys))
        if n == 0:
            return None
        views = [self.stored.get(k, torch.zeros(size, dtype=torch.uint8))
                 for k, size in zip(keys[:n], self.sizes(keys, tail_tokens))]
        return FakeLease(keys[:n], views, request)

    def release(self, lease, **report):
        self.released.append({"request": lease.request, **report})
        return lease.request not in self.lose

    def reserve(self, keys, first=0, request=None, tail_tokens=0):
        self.reserved.append(request)
        return FakeLease(keys, [torch.zeros(size, dtype=torch.uint8) for size in self.sizes(keys, tail_tokens)],
                         request)

    def commit(self, lease):
        self.committed.append((lease.request, list(lease.keys)))
        self.stored.update(zip(lease.keys, lease.views, strict=True))

    def abandon(self, lease):
        self.abandoned.append(lease.request)


def worker(client, inline: bool | None = None) -> WorkerSide:
    w = WorkerSide(client, client, LAYOUT, BLOCK, adapter_for("CPU_ATTN"), inline=inline)
    kv = {f"l{i}": torch.zeros(NUM_BLOCKS, 1, BLOCK, 4) for i in range(LAYOUT.num_layers)}  # CPU layout
    w.register(kv, NUM_BLOCKS)
    assert w.enabled
    return w


def step(w: WorkerSide, meta: KVTierMetadata, *, loads_after_forward=False, errors_first=False) -> set[int]:
    """One step as vLLM's model runner drives it; returns the blocks reported as load errors."""
    w.bind(meta)
    if not loads_after_forward:
        w.start_load_kv()
    errors: set[int] = set()
    for i, kv in enumerate(w.kv):
        w.wait_for_layer_load(f"l{i}")
        w.save_kv_layer(f"l{i}", kv)
    if loads_after_forward:
        w.start_load_kv()
    if errors_first:  # speculative decoding: vLLM asks before the deferred wait_for_save, and
        errors = w.get_block_ids_with_load_errors()  # not again in this step
        w.wait_for_save()
        w._calls.drain()  # the step's commits, which it does not wait for
        return errors
    w.wait_for_save()
    w._calls.drain()
    return w.get_block_ids_with_load_errors()


def load(rid, keys, blocks, first=0, skip=0, tail=0) -> Transfer:
    return Transfer(rid, keys, first, blocks, skip_blocks=skip, tail_blocks=tail)


class GatedReserve(FakeClient):
    """A reserve that waits for ``gate`` (a daemon slow to answer, or stalled, until it opens)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def reserve(self, keys, first=0, request=None, tail_tokens=0):
        self.gate.wait(10)
        return super().reserve(keys, first, request, tail_tokens)


# -- the ranks of a multi-rank engine ----------------------------------------------------------

def ranks(clients: list[FakeClient]) -> list[WorkerSide]:
    """A worker half per client, each a rank of an engine of ``len(clients)`` ranks."""
    out = []
    for client in clients:
        w = WorkerSide(client, client, LAYOUT, BLOCK, adapter_for("CPU_ATTN"), ranks=len(clients))
        w.register({f"l{i}": torch.zeros(NUM_BLOCKS, 1, BLOCK, 4) for i in range(LAYOUT.num_layers)}, NUM_BLOCKS)
        assert w.enabled
        out.append(w)
    return out


def run(workers: list[WorkerSide], tally: Tally, meta: KVTierMetadata) -> dict[int, set[int]]:
    """One step on every rank, in order (stage 0 first); their metadata merged as vLLM merges
    it and counted. Returns each rank's load errors."""
    errors = {r: step(w, meta) for r, w in enumerate(workers)}
    merged = None
    for w in workers:
        m = w.take_meta()
        if m is not None:
            merged = m if merged is None else merged.aggregate(m)
    if merged is not None:
        tally.count(merged.votes)
    return errors


def finished_on_every_rank(workers: list[WorkerSide], meta: KVTierMetadata, want: set[str],
                           timeout_s: float = 10.0) -> list[set[str]]:
    """Steps on every rank (the first carrying ``meta``, the others empty, as vLLM steps while it
    keeps finished requests' blocks) until each rank reported ``want`` finished, or
    ``timeout_s``; what each rank reported."""
    done: list[set[str]] = [set() for _ in workers]
    deadline = time.monotonic() + timeout_s
    while done != [want] * len(workers) and time.monotonic() < deadline:
        for rank, w in enumerate(workers):
            w.bind(meta)
            w.wait_for_save()
            done[rank] |= w.get_finished(set())[0] or set()
        meta = KVTierMetadata()
        time.sleep(0.01)
    return done
