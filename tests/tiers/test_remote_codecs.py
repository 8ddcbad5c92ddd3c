"""The remote tiers through a codec, against real servers (valkey-server, mooncake_master and a
mooncake_client holding the pool): smaller objects, raw bytes out (within the codec's bound),
chunks of any codec read by a tier of any codec, damage a counted miss, ``none`` unchanged."""

from __future__ import annotations

import struct
import time

import pytest
import torch
import xxhash

from kvtier.core.keys import ChunkKey
from kvtier.tiers.codec_types import CODEC_IDS, KVFormat
from kvtier.tiers.codecs import error_bound, frame_bytes
from kvtier.tiers.coded import Coding
from kvtier.tiers.mooncake import MooncakeTier, MooncakeTierConfig
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_format import (
    FIXED_BYTES,
    CorruptObject,
    ObjectHeader,
    header_len,
    peek_header_len,
)
from kvtier.tiers.valkey import ValkeyTier, ValkeyTierConfig
from tests.remote_servers import unique_prefix, wait_until

FMT = KVFormat("float32", 32, 2)
LAYERS = 4
SEG = 2 * 2 * 64 * 32 * 4  # K and V, 2 heads x 64 tokens x 32 dims, float32: 32 KiB a layer
ENTRY = LAYERS * SEG
CODED_HEADER = header_len(LAYERS, coded=True)


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def chunk(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return (torch.randn(ENTRY // 4, generator=g) * 3).view(torch.uint8)


def within_bound(got: torch.Tensor, raw: torch.Tensor, codec: str) -> bool:
    for layer in range(LAYERS):
        part = raw[layer * SEG : (layer + 1) * SEG]
        err = (got[layer * SEG : (layer + 1) * SEG].view(torch.float32) - part.view(torch.float32)).abs()
        if not bool((err.view(2, -1, 32) <= error_bound(codec, part, FMT)).all()):
            return False
    return True


def raw_object(k: ChunkKey, raw: torch.Tensor) -> bytes:
    """The object a raw chunk has always been stored as (version 1)."""
    view = memoryview(raw.numpy())
    return ObjectHeader.for_payload(k, view, SEG).encode() + bytes(view)


# -- each backend's tiers, and the server's own view of what they stored ----------------------
class ValkeyBackend:
    def __init__(self, server) -> None:
        self.address = server.address
        self.client = server.client()

    def open(self, codec: str = "none", prefix: str | None = None, **kw) -> RemoteTier:
        cfg = ValkeyTierConfig((self.address,), 1 << 30, prefix=prefix or unique_prefix(), codec=codec, **kw)
        return ValkeyTier(cfg)

    def _names(self, tier: RemoteTier, k: ChunkKey) -> tuple[str, str]:
        tag = f"{{{tier.config.prefix}:{k.hex()}}}"
        return f"{tag}:h", f"{tag}:d"

    def stored_bytes(self, tier: RemoteTier, k: ChunkKey) -> int:
        """What the server holds for the chunk (STRLEN of header and payload)."""
        return sum(self.client.strlen(n) for n in self._names(tier, k))

    def read(self, tier: RemoteTier, k: ChunkKey) -> bytes:
        h, d = self._names(tier, k)
        return self.client.get(h) + self.client.get(d)

    def write(self, tier: RemoteTier, k: ChunkKey, obj: bytes) -> None:
        h, d = self._names(tier, k)
        hlen = peek_header_len(obj)
        self.client.mset({h: bytes(obj[:hlen]), d: bytes(obj[hlen:])})

    def close(self) -> None:
        self.client.close()


class MooncakeBackend:
    def __init__(self, servers) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.master = servers.master_address
        self.raw = MooncakeDistributedStore()
        assert self.raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.master) == 0

    def open(self, codec: str = "none", prefix: str | None = None, **kw) -> RemoteTier:
        cfg = MooncakeTierConfig(self.master, 1 << 30, prefix=prefix or unique_prefix(), codec=codec, **kw)
        return MooncakeTier(cfg)

    def stored_bytes(self, tier: RemoteTier, k: ChunkKey) -> int:
        return self.raw.get_size(f"{tier.config.prefix}:{k.hex()}")

    def read(self, tier: RemoteTier, k: ChunkKey) -> bytes:
        return bytes(self.raw.get(f"{tier.config.prefix}:{k.hex()}"))

    def write(self, tier: RemoteTier, k: ChunkKey, obj: bytes) -> None:
        assert self.raw.upsert(f"{tier.config.prefix}:{k.hex()}", bytes(obj)) == 0

    def close(self) -> None:
        self.raw.close()


@pytest.fixture(scope="module")
def valkey_backend(valkey_standalone):
    b = ValkeyBackend(valkey_standalone)
    yield b
    b.close()


@pytest.fixture(scope="module")
def mooncake_backend(mooncake_shared):
    b = MooncakeBackend(mooncake_shared)
    yield b
    b.close()


@pytest.fixture(params=["valkey", "mooncake"])
def backend(request):
    return request.getfixturevalue(f"{request.param}_backend")


# -- the object format ------------------------------------------------------------------------
def test_a_coded_header_round_trips_and_a_raw_one_is_unchanged():
    coding = Coding("int8", ENTRY, SEG, frame_bytes("int8", SEG, FMT))
    header = ObjectHeader(key(1), LAYERS * coding.frame, coding.frame, (1, 2, 3, 4), coding)
    raw = header.encode()
    assert len(raw) == header.length == CODED_HEADER == header_len(LAYERS) + 16
    assert struct.unpack_from("<HH", raw, 4) == (2, CODEC_IDS["int8"])
    assert ObjectHeader.decode(raw, key(1)) == header and header.raw_nbytes == ENTRY
    assert header.span(SEG + 5, 10) == (coding.frame, 2 * coding.frame)  # one frame for a range in it
    plain = ObjectHeader(key(1), ENTRY, SEG, (1, 2, 3, 4))
    assert struct.unpack_from("<HH", plain.encode(), 4) == (1, 0) and len(plain.encode()) == header_len(LAYERS)
    assert ObjectHeader.decode(plain.encode()).coding is None

    def forged(at: int, fmt: str, value: int) -> bytes:  # a field changed, the header checksum redone
        body = bytearray(raw[:-8])
        struct.pack_into(fmt, body, at, value)
        return bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body)))

    with pytest.raises(CorruptObject, match="unknown codec"):
        ObjectHeader.decode(forged(6, "<H", 9))
    with pytest.raises(CorruptObject, match="raw sizes"):
        ObjectHeader.decode(forged(FIXED_BYTES, "<Q", ENTRY + 1))
    with pytest.raises(CorruptObject, match="unsupported version"):
        ObjectHeader.decode(forged(4, "<H", 3))


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_kv_goes_up_compressed_and_comes_back_raw_within_the_codec_bound(backend, codec):
    raw, late = chunk(1), []
    with backend.open(codec) as tier:
        assert tier.codec == codec and tier.put(key(1), raw, SEG, fmt=FMT)
        stored = CODED_HEADER + LAYERS * frame_bytes(codec, SEG, FMT)
        assert backend.stored_bytes(tier, key(1)) == stored < 0.6 * ENTRY  # the server's own figure
        assert tier.used == stored and tier.entry_bytes(key(1)) == ENTRY and tier.contains(key(1))
        assert struct.unpack_from("<HH", backend.read(tier, key(1)), 4) == (2, CODEC_IDS[codec])
        got = tier.get(key(1))
        assert got.numel() == ENTRY and not torch.equal(got, raw) and within_bound(got, raw, codec)
        out = torch.empty(SEG, dtype=torch.uint8)  # one layer alone decodes one frame, into `out`
        assert tier.get(key(1), out=out, offset=2 * SEG, length=SEG) is out
        assert torch.equal(out, got[2 * SEG : 3 * SEG])
        assert torch.equal(tier.get(key(1), offset=SEG + 100, length=5000), got[SEG + 100 : SEG + 5100])
        whole = torch.zeros(ENTRY, dtype=torch.uint8)
        assert tier.get_into(key(1), whole, late.append) and torch.equal(whole, got)
        assert tier.stats.bytes_read == 2 * ENTRY + SEG + 5000  # counted in raw bytes
        assert tier.stats.bytes_written == stored - CODED_HEADER  # counted as sent
        assert late == [] and tier.stats.errors == 0


def test_a_chunk_is_read_whatever_codec_the_reader_has(backend):
    prefix, raw, late = unique_prefix(), chunk(2), []
    with backend.open("int8", prefix) as int8, backend.open("none", prefix) as plain:
        assert int8.put(key(1), raw, SEG, fmt=FMT)
        decoded = int8.get(key(1))
        assert plain.entry_bytes(key(1)) == ENTRY  # from the index, or the header
        assert torch.equal(plain.get(key(1), offset=3 * SEG, length=SEG), decoded[3 * SEG :])
        assert torch.equal(plain.get(key(1)), decoded)
        assert plain.put(key(2), raw, SEG, fmt=FMT)  # a tier without a codec stores KV raw
        assert backend.read(plain, key(2)) == raw_object(key(2), raw)
        for reader in (plain, int8):  # batched reads of both kinds, by a tier of each codec
            outs = [torch.zeros(ENTRY, dtype=torch.uint8) for _ in range(3)]
            assert reader.get_many_into([key(1), key(2), key(3)], outs, late.append) == [True, True, False]
            assert torch.equal(outs[0], decoded) and torch.equal(outs[1], raw)
        assert late == [] and plain.stats.corrupt == int8.stats.corrupt == 0


def test_codec_none_and_what_is_not_framed_store_the_same_bytes_as_before(backend):
    raw = chunk(3)
    with backend.open("none") as tier:
        assert tier.put(key(1), raw, SEG, fmt=FMT)
        assert backend.read(tier, key(1)) == raw_object(key(1), raw) and torch.equal(tier.get(key(1)), raw)
    with backend.open("int8") as tier:
        nan = raw.clone().view(torch.float32)
        nan[3] = float("nan")  # a value no codec frames
        entries = [raw, raw[: 3 * SEG - 4], nan.view(torch.uint8)]
        assert tier.put(key(1), entries[0], SEG)  # no format: not known to be KV
        assert tier.put(key(2), entries[1], fmt=FMT)  # one segment, not whole rows
        assert tier.put(key(3), entries[2], SEG, fmt=FMT)
        for i, entry in enumerate(entries, 1):
            assert torch.equal(tier.get(key(i)), entry) and tier.entry_bytes(key(i)) == entry.numel()
        assert backend.read(tier, key(1)) == raw_object(key(1), raw)
        # a batch mixes both: each entry by its own format
        assert tier.put_many([key(4), key(5)], [raw, raw], SEG, fmts=[FMT, None]) == [True, True]
        assert backend.stored_bytes(tier, key(4)) < backend.stored_bytes(tier, key(5)) == header_len(LAYERS) + ENTRY


# -- damage -----------------------------------------------------------------------------------
def test_a_corrupted_compressed_chunk_is_a_counted_miss_never_wrong_bytes(backend, caplog):
    frame, late = frame_bytes("int8", SEG, FMT), []
    with backend.open("int8") as tier:
        assert tier.put_many([key(i) for i in range(3)], [chunk(i) for i in range(3)], SEG,
                             fmts=[FMT] * 3) == [True] * 3
        good = tier.get(key(0), offset=0, length=SEG)
        obj = bytearray(backend.read(tier, key(0)))
        obj[CODED_HEADER + 2 * frame + 100] ^= 0x10  # one quantized element of the third frame
        backend.write(tier, key(0), obj)
        assert torch.equal(tier.get(key(0), offset=0, length=SEG), good)  # frame 0 still verifies
        assert tier.get(key(0)) is None
        assert "checksum mismatch in segment 2" in caplog.text
        assert tier.stats.corrupt == 1 and tier.stats.errors == 1 and not tier.contains(key(0))
        # frames that verify but do not decode (a writer's bug): a miss too, in a batch
        obj = backend.read(tier, key(1))
        header = ObjectHeader.decode(obj, key(1))
        payload = bytearray(obj[CODED_HEADER:])
        payload[frame : frame + 4] = b"JUNK"  # frame 1's magic
        forged = ObjectHeader.for_payload(key(1), memoryview(payload), frame, header.coding).encode()
        backend.write(tier, key(1), forged + payload)
        outs = [torch.zeros(ENTRY, dtype=torch.uint8) for _ in range(2)]
        assert tier.get_many_into([key(1), key(2)], outs, late.append) == [False, True]
        assert "undecodable frame" in caplog.text and within_bound(outs[1], chunk(2), "int8")
        assert tier.stats.corrupt == 2 and tier.stats.misses == 2 and not tier.contains(key(1))
        assert tier.keys() == [key(2)] and late == []


def test_an_object_of_a_format_this_version_does_not_know_is_a_miss_left_in_place(backend, caplog):
    import struct

    import xxhash

    with backend.open("int8") as tier:
        assert tier.put(key(1), chunk(1), SEG, fmt=FMT)
        obj = bytearray(backend.read(tier, key(1)))
        obj[6:8] = (9).to_bytes(2, "little")  # a codec id a later version may add
        end = CODED_HEADER - 8
        obj[end:CODED_HEADER] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(obj[:end])))
        backend.write(tier, key(1), obj)
        assert tier.get(key(1)) is None
        assert "unknown codec id 9" in caplog.text and "left in place" in caplog.text
        assert tier.stats.misses == 1 and tier.stats.corrupt == 0
        assert backend.read(tier, key(1)) == bytes(obj)  # not deleted: another reader may know it


def test_a_truncated_compressed_object_is_a_counted_miss(backend):
    with backend.open("int8") as tier:
        assert tier.put(key(1), chunk(1), SEG, fmt=FMT)
        backend.write(tier, key(1), backend.read(tier, key(1))[:-10])
        assert tier.get(key(1)) is None and tier.stats.corrupt == 1 and tier.keys() == []


# -- the paths particular to one backend ------------------------------------------------------
def test_a_valkey_cluster_stores_and_reads_coded_chunks(valkey_cluster):
    cfg = ValkeyTierConfig(tuple(valkey_cluster.addresses), 1 << 30, cluster=True, prefix=unique_prefix(),
                           codec="int4")
    with ValkeyTier(cfg) as tier:
        assert tier.put_many([key(1), key(2)], [chunk(1), chunk(2)], SEG, fmts=[FMT, None]) == [True, True]
        assert tier.used == CODED_HEADER + LAYERS * frame_bytes("int4", SEG, FMT) + header_len(LAYERS) + ENTRY
        outs = [torch.zeros(ENTRY, dtype=torch.uint8) for _ in range(2)]
        assert tier.get_many_into([key(1), key(2)], outs, lambda _: None) == [True, True]
        assert within_bound(outs[0], chunk(1), "int4") and torch.equal(outs[1], chunk(2))
        assert torch.equal(tier.get(key(1), offset=SEG, length=SEG), outs[0][SEG : 2 * SEG])


def test_the_uploader_and_the_tenant_tiers_pass_formats_down(valkey_backend):
    from kvtier.store.uploader import Uploader
    from kvtier.tiers.tenants import TenantTiers, tenant_prefix

    prefix = unique_prefix()
    tiers = TenantTiers(lambda t: valkey_backend.open("int8", tenant_prefix(prefix, t)), lambda k: "acme")
    uploader = Uploader(tiers, SEG, max_queued=4)
    try:
        done: list[bool] = []  # an upload goes where the chunk's own tenant says
        assert uploader.submit(key(1), chunk(1), done.append, SEG, FMT, tenant="acme")
        assert uploader.submit(key(2), chunk(2), done.append, SEG, tenant="acme")
        assert uploader.flush(timeout=10) and done == [True, True]
        acme = tiers._tier("acme")
        assert valkey_backend.stored_bytes(acme, key(1)) == CODED_HEADER + LAYERS * frame_bytes("int8", SEG, FMT)
        assert valkey_backend.read(acme, key(2)) == raw_object(key(2), chunk(2))
        assert within_bound(tiers.get(key(1)), chunk(1), "int8") and tiers.entry_bytes(key(1)) == ENTRY
    finally:
        uploader.close()
        tiers.close()


def test_mooncake_reads_of_unknown_coded_chunks_go_through_staging(mooncake_backend):
    """A reader that does not know a chunk is coded tries the straight read, sees the shape is
    not the raw one, and reads it whole into staging: decoded, in one batch; a buffer of the
    wrong size is still the caller's error."""
    prefix, late = unique_prefix(), []
    with mooncake_backend.open("int8", prefix) as writer, mooncake_backend.open("none", prefix) as reader:
        assert writer.put_many([key(i) for i in range(4)], [chunk(i) for i in range(4)], SEG,
                               fmts=[FMT] * 4) == [True] * 4
        outs = [torch.zeros(ENTRY, dtype=torch.uint8) for _ in range(4)]
        assert reader.get_many_into([key(i) for i in range(4)], outs, late.append) == [True] * 4
        assert all(torch.equal(outs[i], writer.get(key(i))) for i in range(4))
        assert reader.stats.hits == 4 and reader.stats.bytes_read == 4 * ENTRY and late == []
        for tier in (writer, reader):
            with pytest.raises(ValueError, match="out must be"):
                tier.get_into(key(1), torch.zeros(ENTRY - 1, dtype=torch.uint8), late.append)


def test_a_mooncake_read_of_coded_chunks_given_up_on_never_writes_the_buffers_later(mooncake_private):
    """The holder of the bytes stalls: the staged read is a miss within the timeout, passes no
    future to ``late`` (it reads into the tier's staging, not the callers' buffers), and the
    buffers stay untouched after the abandoned call ends."""
    mooncake_private.start()
    cfg = MooncakeTierConfig(mooncake_private.master_address, 1 << 30, prefix=unique_prefix(), codec="int8",
                             timeout_s=0.5, reconnect_interval_s=0.2)
    tier = MooncakeTier(cfg)
    try:
        assert tier.put_many([key(1), key(2)], [chunk(1), chunk(2)], SEG, fmts=[FMT] * 2) == [True, True]
        outs, late = [torch.zeros(ENTRY, dtype=torch.uint8) for _ in range(2)], []
        mooncake_private.holder.pause()
        try:
            t0 = time.monotonic()
            assert tier.get_many_into([key(1), key(2)], outs, late.append) == [False, False]
            assert time.monotonic() - t0 < 1.5 and tier.stats.errors >= 1 and late == []
        finally:
            mooncake_private.holder.resume()
        wait_until(lambda: not tier._conn._pending, timeout_s=30)  # the abandoned call has ended
        assert all(not o.any() for o in outs)
        assert wait_until(lambda: tier.get_many_into([key(1), key(2)], outs, late.append) == [True, True],
                          timeout_s=30)
        assert within_bound(outs[0], chunk(1), "int8") and within_bound(outs[1], chunk(2), "int8")
    finally:
        tier.close()


# -- configuration ----------------------------------------------------------------------------
def test_a_bad_codec_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="valkey: codec must be one of"):
        ValkeyTierConfig(("127.0.0.1:6379",), 1 << 20, codec="zstd")
    with pytest.raises(ValueError, match="mooncake: codec must be one of"):
        MooncakeTierConfig("127.0.0.1:50051", 1 << 20, codec="auto")
    assert ValkeyTierConfig(("127.0.0.1:6379",), 1 << 20).codec == "none"
