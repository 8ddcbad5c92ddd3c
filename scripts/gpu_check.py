#!/usr/bin/env python3
"""A short check of the vLLM connector's device copies on a machine with a GPU.

    python scripts/gpu_check.py            # every page adapter, CUDA if present (else CPU)

For each attention backend's page layout: chunks are loaded from page-locked host memory into KV
blocks on the device (side stream, one event per layer, the compute stream waiting on the
event) and saved back (save stream after the compute stream), and must round-trip exactly; then
the load bandwidth is printed. Exit status 0 when every check passes.
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
    copier.start()
    for layer, k in enumerate(out):  # load: host slots -> other device blocks
        lo = layout.layer_offset(layer)
        for view, ids in zip(views, dst_blocks, strict=True):
            pages = a.pages(view[lo : lo + layout.layer_bytes], k, per_chunk)
            copier.load(lambda k=k, ids=ids, p=pages: a.scatter(k, copier.ids(ids), copier.up(p)))
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
