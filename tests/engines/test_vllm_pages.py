"""Each page adapter on a layer's KV tensor exactly as vLLM 0.32 to 0.34 hand it to
``register_kv_caches``: built by vLLM's own spec classes, placement strides and
``allocate_kv_cache`` (what its GPU and CPU model runners call), in every physical layout vLLM
knows, with and without kernel blocks that split a block. The adapter accepts it, and a save
then a load moves exactly the bytes of the chosen blocks -- each page as the backend's kernels
read the block -- and not one other byte of the allocation. The page format, from vLLM's own
config and its own choice of CPU attention ISA: engines whose pages differ in any way never
share a chunk, and those whose pages no format can name are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvtier.core.layout import KVLayout
from kvtier.engines.vllm.pages import ADAPTERS, adapter_for, engine_page_format, page_format
from kvtier.server.client import StoreClient

BLOCKS, BS = 12, 16
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", chunk_tokens=2 * BS)
LATENT = 24  # an MLA layer's latent (kv_lora_rank + rope dims) per token
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")  # vLLM's KVCacheLayout
GPU = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


def mla_layout(block_size: int) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=1, head_dim=LATENT, dtype="bfloat16", chunk_tokens=2 * block_size,
                    kv=1)


def spec_of(backend: str, block_size: int = BS):  # type: ignore[no-untyped-def]
    """The KV cache spec vLLM gives a layer of ``backend`` (its attention layer's spec, then the
    backend's own changes where its class loads without a GPU: ``customize_attention_spec``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    if "MLA" in backend:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=LAYOUT.num_kv_heads, head_size=LAYOUT.head_dim,
                                 dtype=torch.bfloat16)
    backend_class = vllm_backend(backend)
    return spec if backend_class is None else customize_attention_spec(backend_class, spec)


def vllm_backend(backend: str):  # type: ignore[no-untyped-def]
    """vLLM's backend class, or None where it needs CUDA or FlashInfer to load."""
    import importlib

    where = {"CPU_ATTN": ("cpu_attn", "CPUAttentionBackend"), "FLASH_ATTN": ("flash_attn", "FlashAttentionBackend"),
             "TRITON_ATTN": ("triton_attn", "TritonAttentionBackend"), "FLASHMLA": ("mla.flashmla", "FlashMLABackend"),
             "CPU_MLA": ("mla.cpu_mla", "CPUMLABackend")}.get(backend)
    if where is None:
        return None
    return getattr(importlib.import_module(f"vllm.v1.attention.backends.{where[0]}"), where[1])


def vllm_layers(spec, layout: str, num_blocks: int = BLOCKS, kernel_block_size: int | None = None,  # type: ignore[no-untyped-def]
                seed: int | None = 0) -> list[torch.Tensor]:
    """Three layers' KV tensors as vLLM hands them over: placed by its strides for ``layout``
    (as ``kv_cache_utils`` places one group's layers) and viewed by ``allocate_kv_cache``; every
    byte of the allocation random (``seed``), or zero (None)."""
    from vllm.v1 import kv_cache_interface as vkv
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    physical = KVCacheLayout[layout]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    layer_stride, block_stride, *_ = vkv.compute_layout_strides(spec, num_blocks, len(names), physical)
    placed = vkv.KVCacheTensor(size=len(names) * num_blocks * spec.page_size_bytes, layers=names,
                               layer_stride=layer_stride, block_stride=block_stride)
    config = vkv.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[placed],
                               kv_cache_groups=[vkv.KVCacheGroupSpec(names, spec)])
    kv = allocate_kv_cache(config, torch.device("cpu"), physical,
                           None if kernel_block_size is None else [kernel_block_size])
    if seed is not None:
        raw = allocation(kv[names[0]])
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return [kv[name] for name in names]


def allocation(kv: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation ``kv`` views (all layers, all blocks)."""
    return torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def kernel_page(backend: str, kv: torch.Tensor, row: int) -> torch.Tensor:
    """Row ``row`` of vLLM's view as ``[H, tokens, C]``, assembled from where the backend's kernels
    find each token's K and V (or latent)."""
    if backend in GPU:  # flash_attn.py et al.: kv_cache.transpose(1, 2).split(head_size, dim=-1)
        k, v = kv.transpose(1, 2).split(LAYOUT.head_dim, dim=-1)
        return torch.cat([k[row], v[row]], dim=-1).transpose(0, 1)
    if "MLA" in backend:  # mla_attention.py bind_kv_cache: kv_cache.squeeze(1), [blocks, tokens, latent]
        return kv.squeeze(1)[row].unsqueeze(0)
    return kv[row]  # CPU_ATTN: the block as its ISA packs it, K's half then V's (cpu_attn.py)


def reference_page(backend: str, kv: torch.Tensor, block: int, ratio: int) -> torch.Tensor:
    """Block ``block`` of the scheduler: its ``ratio`` kernel blocks' tokens in order
    (``AttentionGroup.map_to_kernel_block_table``: kernel block j of block b is b * ratio + j)."""
    return torch.cat([kernel_page(backend, kv, block * ratio + j) for j in range(ratio)], dim=1)


def round_trip(backend: str, layout: KVLayout, src: torch.Tensor, dst: torch.Tensor, block_size: int,
               ratio: int = 1) -> torch.Tensor:
    """Save blocks 7 and 2 of ``src`` (as vLLM hands it over) into a chunk layer, both ways a
    worker saves, then load them into blocks 3 and 9 of ``dst`` (all zero): the stored pages are
    the blocks as the kernels read them, the loaded blocks equal the saved ones, and no other
    byte of ``dst``'s allocation changed. Returns the stored chunk layer."""
    a = adapter_for(backend)
    kv, out = (a.by_block(t, BLOCKS, block_size) if ratio > 1 else t for t in (src, dst))
    a.check(kv, BLOCKS, block_size, layout)
    assert a.page_bytes(kv) * (layout.chunk_tokens // block_size) == layout.layer_bytes
    stored = torch.zeros(layout.layer_bytes, dtype=torch.uint8)
    a.pages(stored, kv, 2).copy_(a.gather(kv, torch.tensor([7, 2])))  # (a GPU's saves)
    straight = torch.zeros_like(stored)
    assert a.gather_into(kv, torch.tensor([7, 2]), a.pages(straight, kv, 2))  # (a CPU's saves)
    assert torch.equal(straight, stored)
    want = torch.cat([as_bytes(reference_page(backend, src, b, ratio)) for b in (7, 2)])
    assert torch.equal(stored, want)
    a.scatter(out, torch.tensor([3, 9]), a.pages(stored, kv, 2))
    for s, d in ((7, 3), (2, 9)):
        assert torch.equal(as_bytes(reference_page(backend, dst, d, ratio)), as_bytes(reference_page(backend, src, s, ratio)))
        for row in range(d * ratio, (d + 1) * ratio):
            dst[row].zero_()  # through vLLM's own view: exactly the loaded block's bytes
    assert not allocation(dst).any(), "a load wrote outside its blocks"
    return stored


CASES = [(b, lay) for b in ("CPU_ATTN", *GPU) for lay in VLLM_LAYOUTS]


@pytest.mark.parametrize(("backend", "layout"), CASES)
def test_a_layer_as_vllm_hands_it_over_goes_out_and_back_exactly(backend, layout):
    spec = spec_of(backend)
    src, dst = vllm_layers(spec, layout)[1], vllm_layers(spec, layout, seed=None)[1]
    assert tuple(src.shape) == (BLOCKS, LAYOUT.num_kv_heads, BS, 2 * LAYOUT.head_dim)
    round_trip(backend, LAYOUT, src, dst, BS)


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
@pytest.mark.parametrize(("backend", "block"), [("CPU_MLA", 16), ("FLASHMLA", 64), ("TRITON_MLA", 16)])
def test_an_mla_layer_as_vllm_hands_it_over_goes_out_and_back_exactly(backend, block, layout):
    spec = spec_of(backend, block)
    src, dst = vllm_layers(spec, layout)[1], vllm_layers(spec, layout, seed=None)[1]
    assert tuple(src.shape) == (BLOCKS, 1, block, LATENT)
    round_trip(backend, mla_layout(block), src, dst, block)


class FlashInferOffBlackwell:
    """FlashInfer's kernel block sizes off Blackwell (flashinfer.py
    ``get_supported_kernel_block_sizes``): its class needs FlashInfer to load."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):  # type: ignore[no-untyped-def]
        return [16, 32, 64]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])  # (vLLM splits blocks only in layouts with dense pages)
@pytest.mark.parametrize("backend", ["FLASHINFER", "FLASHMLA"])
def test_blocks_vllm_splits_into_kernel_blocks_go_out_and_back_whole(backend, layout):
    """vLLM hands over kernel blocks where the backend's kernels take fewer tokens than a block
    (``prepare_kernel_block_sizes``): ``[blocks * r, H, block / r, C]``. The adapter refuses that
    tensor as is, and takes it viewed one row per block (``by_block``); a page is then the same
    bytes as an engine's whose kernels take whole blocks."""
    from vllm.v1.worker.utils import select_common_block_size

    block = 128
    spec = spec_of(backend, block)
    layout_of = mla_layout(block) if "MLA" in backend else replace(LAYOUT, chunk_tokens=2 * block)
    kernel = select_common_block_size(block, [vllm_backend(backend) or FlashInferOffBlackwell], [spec])
    assert kernel == 64  # vLLM's own choice
    src, dst = vllm_layers(spec, layout, kernel_block_size=kernel)[1], vllm_layers(spec, layout, kernel_block_size=kernel, seed=None)[1]
    assert src.shape[0] == 2 * BLOCKS and src.shape[2] == kernel
    a = adapter_for(backend)
    with pytest.raises(ValueError, match=r"splits each 128-token block into 2 kernel blocks of 64 tokens"):
        a.check(src, BLOCKS, block, layout_of)
    stored = round_trip(backend, layout_of, src, dst, block, ratio=2)
    whole = vllm_layers(spec, layout, seed=None)[1]  # the same KV in an engine without kernel blocks
    for b in range(BLOCKS):
        whole[b].copy_(reference_page(backend, src, b, 2))
    a.check(whole, BLOCKS, block, layout_of)
    assert torch.equal(as_bytes(a.gather(whole, torch.tensor([7, 2]))), stored)


def test_tensors_not_as_vllm_hands_them_over_are_refused_naming_what_was_seen():
    spec = spec_of("FLASH_ATTN")
    kv = vllm_layers(spec, "LBNHC")[0]
    a = adapter_for("FLASH_ATTN")
    old = torch.zeros(2, BLOCKS, BS, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=torch.bfloat16)  # vLLM <= 0.31
    with pytest.raises(ValueError, match=r"FLASH_ATTN.*\(12, 2, 16, 16\).*\(2, 12, 16, 2, 8\)"):
        a.check(old, BLOCKS, BS, LAYOUT)
    with pytest.raises(ValueError, match=r"\(12, 2, 16, 16\).*\(12, 2, 8, 16\)"):  # blocks of 8, not 16
        a.check(vllm_layers(spec_of("FLASH_ATTN", 8), "LBNHC")[0], BLOCKS, BS, LAYOUT)
    with pytest.raises(ValueError, match="dtype"):
        a.check(kv.float(), BLOCKS, BS, LAYOUT)
    with pytest.raises(ValueError, match="at least 13 blocks"):
        a.check(kv, BLOCKS + 1, BS, LAYOUT)
    with pytest.raises(ValueError, match="one latent per token"):
        adapter_for("FLASHMLA").check(kv, BLOCKS, BS, LAYOUT)
    mla = vllm_layers(spec_of("FLASHMLA"), "LBHNC")[0]
    with pytest.raises(ValueError, match=r"\(12, 1, 16, 24\)"):  # MLA's layer before vLLM 0.32: [blocks, block, latent]
        adapter_for("FLASHMLA").check(mla.squeeze(1), BLOCKS, BS, mla_layout(BS))
    # vLLM 0.34's extensible KV cache, in a layout that is not block-compact, hands over views of
    # its whole capacity: blocks past the ones committed are never named by a block id
    a.check(vllm_layers(spec, "LHBNC", num_blocks=BLOCKS + 4)[0], BLOCKS, BS, LAYOUT)


def test_every_physical_layout_vllm_knows_is_covered():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {layout.name for layout in KVCacheLayout} == set(VLLM_LAYOUTS)


def test_an_unknown_backend_is_named_and_formats_differ_in_every_part():
    from kvtier.server.http import _BLOCK, _OTHER_RANK

    with pytest.raises(ValueError, match="no page adapter.*'SOMETHING_NEW'"):
        adapter_for("SOMETHING_NEW")
    base = {"backend": "CPU_ATTN", "dtype": "bfloat16", "block_size": 32, "vllm": "0.32", "kernel": "vec"}
    each = [{"backend": b} for b in ADAPTERS] + [
        {"kernel": "amx"}, {"kernel": ""}, {"dtype": "kvfp8"}, {"block_size": 64}, {"vllm": "0.31"},
        {"tp": (0, 2)}, {"tp": (1, 2)}, {"pp": (1, 2)}, {"tp": (1, 2), "pp": (1, 2)}]
    formats = [page_format(**{**base, **change}) for change in each]
    assert len(set(formats)) == len(formats), formats
    assert page_format(**base) == "vllm0.32-cpu_attn.vec-bfloat16-bs32"
    # what the daemon's HTTP lookup reads of a format: the block size, and whether it is rank 0's
    assert all(_BLOCK.search(f)[1] == ("64" if "bs64" in f else "32") for f in formats)
    assert [f for f in formats if not _OTHER_RANK.search(f)] == formats[:-3]


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_a_save_copies_straight_into_the_slot_and_a_slot_of_the_wrong_shape_is_refused(backend):
    from kvtier.engines.vllm.copies import Copier

    a = adapter_for(backend)
    kv = vllm_layers(spec_of(backend), "LBHNC")[0]
    ids = torch.tensor([4, 1])
    dst = a.pages(torch.zeros(2 * a.page_bytes(kv), dtype=torch.uint8), kv, 2)
    Copier(kv.device, 1).save_pages(dst, kv, a, ids)
    assert torch.equal(as_bytes(dst), as_bytes(a.gather(kv, ids)))  # the same bytes as a gather and a copy
    room = a.pages(torch.zeros(3 * a.page_bytes(kv), dtype=torch.uint8), kv, 3)  # three pages, two asked for
    with pytest.raises(ValueError, match="do not fit the slot"):
        a.gather_into(kv, ids, room)
    assert not as_bytes(room).any()  # nothing written


# -- the page format: everything a page's bytes depend on is in the namespace -------------------
def engine_config(model_dir, socket, **kw):
    """vLLM's config of the tiny model (head_dim 32) with kvtier as its connector: bfloat16
    pages of 32-token blocks unless ``kw`` says otherwise. The model part of the namespace is
    pinned (``model_id``), so only the page format can tell two engines apart."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    extra = {"socket": str(socket), "model_id": "tiny@test", "chunk_tokens": 32, "retry_s": 0.05}
    ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.engines.vllm",
                           kv_role="kv_both", kv_connector_extra_config=extra)
    kw = {"dtype": "bfloat16", "block_size": 32, **kw}
    return EngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=256, kv_transfer_config=ktc,
                      **kw).create_engine_config()


def scheduler_half(config):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.engines.vllm.connector import KVTierConnector

    return KVTierConnector(config, KVConnectorRole.SCHEDULER)


@pytest.fixture
def cpu(monkeypatch):
    """The machine vLLM picks its CPU attention ISA on, pinned: x86 with AVX-512; ``cpu(amx=True)``
    makes it one with AMX tiles too (vLLM then packs bfloat16 pages its own way)."""
    from vllm.platforms import CpuArchEnum, current_platform

    monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: CpuArchEnum.X86)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)

    def machine(amx: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)

    machine(False)
    return machine


def test_engines_whose_pages_differ_never_share_a_chunk_in_one_daemon(tiny_model_dir, tmp_path, cpu, monkeypatch):
    """One engine's worker saves three chunks through a real daemon; engines that would lay the
    same tokens' pages out otherwise -- on an AMX machine, under another vLLM release, with fp8
    KV, 64-token blocks, float32, two tensor-parallel ranks -- name other chunks, and find none."""
    import vllm

    from ..server.test_daemon import Daemon

    daemon = Daemon(tmp_path, host_chunks=8).start()
    socket = daemon.socket
    tokens = [5 + i % 97 for i in range(3 * 32)]
    halves = {}
    writer = None
    try:
        base = halves["avx512"] = scheduler_half(engine_config(tiny_model_dir, socket))
        # what its rank-0 worker does: save the chunks, under the namespace the scheduler names
        writer = StoreClient(str(socket), model=base.model_id, layout=base.layout, page_format=base.page_format)
        keys = writer.keys_for(tokens)
        lease = writer.reserve(keys)
        for i, view in enumerate(lease.views):
            view.fill_(i + 1)
        assert writer.commit(lease) == len(keys) == 3
        assert len(base.client.lookup_keys(base.client.keys_for(tokens))) == 3  # its own engine hits
        cpu(amx=True)  # the same engine on a machine with AMX
        halves["amx"] = scheduler_half(engine_config(tiny_model_dir, socket))
        cpu(amx=False)
        release = vllm.__version__
        monkeypatch.setattr(vllm, "__version__", "0.31.1")  # the same engine under another release
        halves["vllm 0.31"] = scheduler_half(engine_config(tiny_model_dir, socket))
        monkeypatch.setattr(vllm, "__version__", release)
        for name, kw in {"fp8 KV": {"kv_cache_dtype": "fp8"}, "64-token blocks": {"block_size": 64},
                         "float32": {"dtype": "float32"}, "TP 2": {"tensor_parallel_size": 2}}.items():
            halves[name] = scheduler_half(engine_config(tiny_model_dir, socket, **kw))
        formats = {name: half.page_format for name, half in halves.items()}
        assert len(set(formats.values())) == len(formats), formats
        for name, half in halves.items():
            if half is base:
                continue
            theirs = half.client.keys_for(tokens)
            assert not set(theirs) & set(keys), f"{name} names the same chunks as the base engine"
            assert half.client.lookup_keys(theirs) == [], f"{name} finds the base engine's chunks"
    finally:
        for half in halves.values():
            half.shutdown()
        if writer is not None:
            writer.close()
        daemon.stop()


def test_an_engine_that_splits_a_blocks_tokens_across_ranks_is_refused_naming_why(tiny_model_dir, tmp_path):
    """Decode context parallelism keeps every other token of a block on each rank: a page is
    then not a run of the block's tokens, which kvtier's chunks are made of."""
    config = engine_config(tiny_model_dir, tmp_path / "kv.sock", tensor_parallel_size=4,
                           decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="decode_context_parallel_size"):
        scheduler_half(config)


def test_both_halves_name_the_isa_vllms_own_choice_and_each_rank_its_shard(tiny_model_dir, tmp_path, cpu,
                                                                           monkeypatch):
    from vllm.v1.attention.backends import cpu_attn

    config = engine_config(tiny_model_dir, tmp_path / "kv.sock", tensor_parallel_size=2, pipeline_parallel_size=2)
    half = scheduler_half(config)
    try:  # the scheduler half names what rank 0's worker does
        assert half.page_format == engine_page_format(config, "CPU_ATTN", 0, 0) == \
            f"vllm{vllm_major_minor()}-cpu_attn.vec-bfloat16-bs32-tp0of2-pp0of2"
    finally:
        half.shutdown()
    ranks = {engine_page_format(config, "CPU_ATTN", tp, pp) for tp in (0, 1) for pp in (0, 1)}
    assert len(ranks) == 4
    cpu(amx=True)
    assert ".amx-" in engine_page_format(config, "CPU_ATTN")
    assert ".vec-" in engine_page_format(engine_config(tiny_model_dir, tmp_path / "kv.sock", dtype="float32"), "CPU_ATTN")
    # whatever vLLM picks is what the format says: it is asked, never second-guessed
    seen = []

    def picked(dtype, block_size, head_size=None, kv_cache_dtype=None):
        seen.append((dtype, block_size, head_size, kv_cache_dtype))
        return "isa9"

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", picked)
    assert ".isa9-" in engine_page_format(config, "CPU_ATTN")
    assert seen == [(torch.bfloat16, 32, 32, "auto")]  # what its attention metadata builder passes
    # a GPU backend's pages are handed over in one logical layout whatever its kernels
    assert engine_page_format(config, "FLASH_ATTN").startswith(f"vllm{vllm_major_minor()}-flash_attn-bfloat16-")


def test_engines_whose_pages_no_format_can_name_are_refused(tiny_model_dir, tmp_path, cpu):
    config = engine_config(tiny_model_dir, tmp_path / "kv.sock", kv_cache_dtype="fp8")
    assert ".vec-kvfp8-" in engine_page_format(config, "CPU_ATTN")
    config.cache_config.kv_cache_dtype_skip_layers = ["0"]  # layer 0 keeps bfloat16 pages
    assert "-kvfp8.skip" in engine_page_format(config, "CPU_ATTN")
    config.cache_config.calculate_kv_scales = True  # (older releases) scales of each engine's own
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        engine_page_format(config, "CPU_ATTN")
    config = engine_config(tiny_model_dir, tmp_path / "kv.sock")
    config.parallel_config.prefill_context_parallel_size = 2  # (not on CPU: its config is refused)
    with pytest.raises(ValueError, match="prefill_context_parallel_size=2 spreads each block's tokens"):
        engine_page_format(config, "FLASH_ATTN")


def vllm_major_minor() -> str:
    import vllm

    return ".".join(vllm.__version__.split(".")[:2])
