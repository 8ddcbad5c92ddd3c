#!/usr/bin/env python3
"""A short check of the vLLM connector's device copies on a machine with a GPU.

    python scripts/gpu_check.py            # every page adapter, CUDA if present (else CPU)

For each attention backend's page layout: chunks are loaded from page-locked host memory into KV
blocks on the device (side stream, one event per layer, the compute stream waiting on the
event) and saved back (save stream after the compute stream), and must round-trip exactly; then
the load bandwidth is printed. Issuing a step's loads must not synchronize the host (CUDA's
sync debug mode is set to error meanwhile).

Then the ordering check: a kernel on the compute stream that writes a destination block just
before a load into it (after a long sleep kernel, so it would finish last if nothing ordered
them) must not win -- the load, in the layer-by-layer path and between steps, lands after it.

Exit status 0 when every check passes.
"""

from __future__ import annotations

import sys
import time

import torch

from kvtier.core.layout import KVLayout
from kvtier.engines.vllm.copies import Copier
from kvtier.engines.vllm.pages import ADAPTERS, adapter_for

BLOCKS, BS, LAYERS = 256, 16, 8


def check(backend: str, device: torch.device) -> float:
    mla = "MLA" in backend
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=1 if mla else 8, head_dim=576 if mla else 128,
                      dtype="float16", chunk_tokens=4 * BS, kv=1 if mla else 2)
    a = adapter_for(backend)
    kv = [torch.randn(a.shape(BLOCKS, BS, layout), dtype=torch.float16, device=device) for _ in range(LAYERS)]
    per_chunk = layout.chunk_tokens // BS
    chunks = 16
    host = torch.empty(chunks * layout.chunk_bytes, dtype=torch.uint8,
                       pin_memory=device.type == "cuda")
    views = [host[i * layout.chunk_bytes : (i + 1) * layout.chunk_bytes] for i in range(chunks)]
    src_blocks = [list(range(i * per_chunk, (i + 1) * per_chunk)) for i in range(chunks)]
    copier = Copier(device, LAYERS)
    for layer, k in enumerate(kv):  # save: device pages -> host slots
        lo = layout.layer_offset(layer)
        for view, ids in zip(views, src_blocks, strict=True):
            copier.save(a.pages(view[lo : lo + layout.layer_bytes], k, per_chunk), a.gather(k, copier.ids(ids)))
    copier.sync_saves()
    out = [torch.zeros_like(k) for k in kv]
    dst_blocks = [list(range(BLOCKS - (i + 1) * per_chunk, BLOCKS - i * per_chunk)) for i in range(chunks)]
    start = time.perf_counter()
    with no_host_sync(device):
        copier.start()
        dst_ids = [copier.load_ids(ids) for ids in dst_blocks]  # once per chunk, as the worker
        for layer, k in enumerate(out):  # load: host slots -> other device blocks
            lo = layout.layer_offset(layer)
            for view, ids in zip(views, dst_ids, strict=True):
                pages = a.pages(view[lo : lo + layout.layer_bytes], k, per_chunk)
                copier.load(lambda k=k, ids=ids, p=pages: a.scatter(k, ids, copier.up(p)))
            copier.layer_done(layer)
        copier.all_done()
    for layer in range(LAYERS):
        copier.wait_layer(layer)  # the compute stream waits; the host goes on
    copier.sync()
    elapsed = time.perf_counter() - start
    for k, o in zip(kv, out, strict=True):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            got = a.gather(o, torch.tensor(d, device=device))
            want = a.gather(k, torch.tensor(s, device=device))
            if not torch.equal(got, want):
                raise AssertionError(f"{backend}: pages did not round-trip")
    return chunks * layout.chunk_bytes / elapsed / 2**30


class no_host_sync:
    """CUDA's sync debug mode set to error inside: an operation that synchronizes the host
    raises."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            self.old = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self.old)


def check_ordering(device: torch.device) -> None:
    """A compute-stream kernel that writes a destination block just before a load into it must
    not win: the load (layer by layer, and between steps) lands after it."""
    layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16", chunk_tokens=BS)
    a = adapter_for("FLASH_ATTN")
    kv = torch.zeros(a.shape(64, BS, layout), dtype=torch.float16, device=device)
    host = torch.full((layout.chunk_bytes // 2,), 7.0, dtype=torch.float16, pin_memory=device.type == "cuda")
    pages = a.pages(host.view(torch.uint8), kv, 1)
    five = torch.tensor([5], device=device)
    for path in ("layer-wise", "between steps"):
        copier = Copier(device, 1)
        kv.zero_()
        marker = torch.full_like(a.gather(kv, five), 3.0)
        if device.type == "cuda":
            torch.cuda.synchronize()  # (nothing below may wait for the host from here on)
            torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while...
        a.scatter(kv, five, marker)  # ...and then writes block 5 (3.0); the load of 7.0 comes after
        if path == "layer-wise":
            copier.start()
            ids = copier.load_ids([5])
            copier.load(lambda c=copier, ids=ids: a.scatter(kv, ids, c.up(pages)))
            copier.layer_done(0)
            copier.all_done()
            copier.wait_layer(0)
            copier.sync()
        else:
            after = copier.mark()
            copier.load_now(kv, a, copier.bg_ids([5]), pages, after)
            copier.sync_now()
        if device.type == "cuda":
            torch.cuda.synchronize()
        got = a.gather(kv, five)
        if not bool((got == 7.0).all()):
            raise AssertionError(f"{path}: the compute stream's earlier write won over the load")


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (no CUDA here)'}")
    failed = 0
    for backend in [*ADAPTERS, "FLASHMLA"]:
        try:
            gibs = check(backend, device)
            print(f"  {backend:12s} ok   load {gibs:6.1f} GiB/s")
        except Exception as exc:  # noqa: BLE001 - report every backend
            failed += 1
            print(f"  {backend:12s} FAIL {exc}")
    try:
        check_ordering(device)
        print("  ordering     ok   a compute-stream write before a load never wins")
    except Exception as exc:  # noqa: BLE001 - report it
        failed += 1
        print(f"  ordering     FAIL {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
