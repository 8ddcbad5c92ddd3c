"""Throughput of the remote tiers against their backend's own client, measured in the same run.

For each backend (Valkey standalone, Mooncake Store over TCP) the benchmark starts its own
loopback servers (:mod:`kvtier.bench.servers`) and, per object size, moves ``count`` objects:

- kvtier: ``tier.put(key, src_i, segment_bytes=size // 32)`` (32 checksummed segments, as the
  layers of a chunk) and ``tier.get_into(key, dst_i, late)`` (how the store promotes a chunk
  from the remote tier into its DRAM or SSD reservation): header, checksums, bookkeeping and
  verification all count against the tier.
- raw Valkey: valkey-py ``SET name memoryview(src_i)`` and ``GET name`` copied into ``dst_i``
  (valkey-py cannot read into a buffer; the tier delivers into ``dst_i`` too, and so does raw
  Mooncake), with the same client settings as the tier's.
- raw Mooncake: ``put_from(name, src_i)`` and ``get_into(name, dst_i)``, zero-copy from and into
  buffers registered once up front (the best case of Mooncake's Python API).

and, in batches (how the store's uploader and its promotions from the remote tier move chunks),
all ``count`` objects in one call: ``tier.put_many`` / ``tier.get_many_into`` against a
valkey-py pipeline of the SETs / GETs (no transaction) and Mooncake's ``batch_put_from`` /
``batch_get_into``.

Both sides use distinct source and destination tensors of the same sizes. A warm-up round (not
kept) comes first; then each of ``rounds`` rounds times four phases (kvtier put, raw put,
kvtier get, raw get), the two sides taking turns object by object or batch by batch (who goes
first alternating), and deletes everything untimed. The figure of a phase is the median of its rounds; throughput is payload bytes / time in GB/s
(1e9 bytes/s) and each ratio is kvtier / raw. A miss or a failed write raises BenchError.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvtier.bench.servers import MooncakeServers, ValkeyServer
from kvtier.errors import KVTierError
from kvtier.tiers.base import Tier

MIB = 1 << 20
GB = 1e9
RATIO_TARGET = 0.8
"""A remote tier should reach at least this share of its backend client's throughput."""
BACKENDS = ("valkey", "mooncake")


class BenchError(KVTierError, RuntimeError):
    """The benchmark could not measure what it claims (a miss, a failed write)."""


@dataclass(frozen=True)
class RemoteBenchConfig:
    backends: tuple[str, ...] = BACKENDS
    sizes: tuple[int, ...] = (MIB, 16 * MIB)
    """Object sizes in bytes."""
    count: int = 8
    """Objects moved per phase and size."""
    rounds: int = 5

    def __post_init__(self) -> None:
        if not self.backends or any(b not in BACKENDS for b in self.backends):
            raise ValueError(f"backends must be some of {BACKENDS}, got {self.backends!r}")
        if not self.sizes or any(not isinstance(s, int) or s < 4096 for s in self.sizes):
            raise ValueError(f"sizes must be ints of at least 4096 bytes, got {self.sizes!r}")
        for field in ("count", "rounds"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{field} must be a positive int, got {v!r}")


MODES = ("each", "batch")
"""One call an object, or all ``count`` objects in one call."""


@dataclass(frozen=True, slots=True)
class RemoteBenchRow:
    backend: str
    size_bytes: int
    mode: str
    put_GBps: float
    raw_put_GBps: float
    get_GBps: float
    raw_get_GBps: float

    @property
    def put_ratio(self) -> float:
        return self.put_GBps / self.raw_put_GBps

    @property
    def get_ratio(self) -> float:
        return self.get_GBps / self.raw_get_GBps

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "put_ratio": self.put_ratio, "get_ratio": self.get_ratio}


@dataclass(frozen=True)
class RemoteBenchResult:
    rows: tuple[RemoteBenchRow, ...]
    config: RemoteBenchConfig
    load_avg: float
    """1-minute load average when the run started (noise on a busy machine)."""

    def as_dict(self) -> dict[str, object]:
        return {"target_ratio": RATIO_TARGET, "count": self.config.count, "rounds": self.config.rounds,
                "load_avg": self.load_avg, "rows": [r.as_dict() for r in self.rows]}


class _Side(Protocol):
    def put(self, i: int) -> None: ...
    def get(self, i: int) -> None: ...
    def put_all(self) -> None: ...
    def get_all(self) -> None: ...
    def check(self) -> None: ...
    def clear(self) -> None: ...


def _tensors(size: int, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(count)]


class _TierSide:
    def __init__(self, tier: Tier, size: int, count: int) -> None:
        self.tier, self.count, self.seg = tier, count, max(4096, size // 32)
        self.src, self.dst = _tensors(size, count, 1), [torch.empty(size, dtype=torch.uint8) for _ in range(count)]

    def _key(self, i: int) -> bytes:
        return (i + 1).to_bytes(16, "little")

    def put(self, i: int) -> None:
        if not self.tier.put(self._key(i), self.src[i], self.seg):
            raise BenchError(f"{self.tier.name}: put {i} failed")

    def get(self, i: int) -> None:
        if not self.tier.get_into(self._key(i), self.dst[i], self._late):
            raise BenchError(f"{self.tier.name}: get {i} missed")

    def put_all(self) -> None:
        got = self.tier.put_many([self._key(i) for i in range(self.count)], self.src, self.seg)
        if got != [True] * self.count:
            raise BenchError(f"{self.tier.name}: put_many failed: {got}")

    def get_all(self) -> None:
        if not all(self.tier.get_many_into([self._key(i) for i in range(self.count)], self.dst, self._late)):
            raise BenchError(f"{self.tier.name}: get_many_into missed")

    def _late(self, _: object) -> None:
        raise BenchError(f"{self.tier.name}: a read timed out")

    def check(self) -> None:
        if not all(torch.equal(s, d) for s, d in zip(self.src, self.dst, strict=True)):
            raise BenchError(f"{self.tier.name}: read back different bytes")

    def clear(self) -> None:
        for i in range(self.count):
            self.tier.delete(self._key(i))


class _RawValkey:
    def __init__(self, server: ValkeyServer, size: int, count: int, timeout_s: float) -> None:
        import valkey

        self.client = valkey.Valkey(host="127.0.0.1", port=server.port, socket_timeout=timeout_s,
                                    socket_connect_timeout=timeout_s)
        self.names = [f"bench:raw:{i}" for i in range(count)]
        self.src = [memoryview(t.numpy()) for t in _tensors(size, count, 2)]
        self.dst = [memoryview(t.numpy()) for t in _tensors(size, count, 3)]
        self.got: list[bytes | None] = [None] * count

    def put(self, i: int) -> None:
        self.client.set(self.names[i], self.src[i])

    def get(self, i: int) -> None:
        got = self.got[i] = self.client.get(self.names[i])
        if got is None:
            raise BenchError(f"valkey raw: get {i} missed")
        self.dst[i][:] = got

    def put_all(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, src in zip(self.names, self.src, strict=True):
            pipe.set(name, src)
        pipe.execute()

    def get_all(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name in self.names:
            pipe.get(name)
        got = self.got = pipe.execute()
        for i, value in enumerate(got):
            if value is None:
                raise BenchError(f"valkey raw: get {i} missed")
            self.dst[i][:] = value

    def check(self) -> None:
        if any(d != s for d, s in zip(self.dst, self.src, strict=True)):
            raise BenchError("valkey raw: read back different bytes")

    def clear(self) -> None:
        self.client.delete(*self.names)
        self.got = [None] * len(self.names)


class _RawMooncake:
    def __init__(self, master: str, size: int, count: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", master) != 0:
            raise BenchError("mooncake raw: setup failed")
        self.size, self.names = size, [f"bench:raw:{i}" for i in range(count)]
        self.src, self.dst = _tensors(size, count, 2), [torch.empty(size, dtype=torch.uint8) for _ in range(count)]
        for t in self.src + self.dst:
            if self.store.register_buffer(t.data_ptr(), size) != 0:
                raise BenchError("mooncake raw: register_buffer failed")

    def put(self, i: int) -> None:
        if self.store.put_from(self.names[i], self.src[i].data_ptr(), self.size) != 0:
            raise BenchError(f"mooncake raw: put {i} failed")

    def get(self, i: int) -> None:
        if self.store.get_into(self.names[i], self.dst[i].data_ptr(), self.size) != self.size:
            raise BenchError(f"mooncake raw: get {i} missed")

    def put_all(self) -> None:
        if self.store.batch_put_from(self.names, [t.data_ptr() for t in self.src], [self.size] * len(self.src)) != [0] * len(self.src):
            raise BenchError("mooncake raw: batch_put_from failed")

    def get_all(self) -> None:
        n = len(self.dst)
        if self.store.batch_get_into(self.names, [t.data_ptr() for t in self.dst], [self.size] * n) != [self.size] * n:
            raise BenchError("mooncake raw: batch_get_into missed")

    def check(self) -> None:
        if not all(torch.equal(s, d) for s, d in zip(self.src, self.dst, strict=True)):
            raise BenchError("mooncake raw: read back different bytes")

    def clear(self) -> None:
        self.store.batch_remove(self.names, True)

    def close(self) -> None:
        for t in self.src + self.dst:
            self.store.unregister_buffer(t.data_ptr())
        self.store.close()


def _measure(tier: _Side, raw: _Side, count: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per mode, median seconds of each phase over ``rounds`` rounds after a warm-up. The two
    sides take turns object by object, or batch by batch (who goes first alternating), so that
    noise from other processes lands on both alike."""
    times = {mode: {"put": [], "raw_put": [], "get": [], "raw_get": []} for mode in MODES}
    clock = time.perf_counter
    for r in range(rounds + 1):
        for mode in MODES:
            for op in ("put", "get"):
                spent = {"": 0.0, "raw_": 0.0}
                for i in range(count if mode == "each" else 1):
                    name = op if mode == "each" else f"{op}_all"
                    pair = [("", getattr(tier, name)), ("raw_", getattr(raw, name))]
                    for side, fn in pair if (i + r) % 2 == 0 else pair[::-1]:
                        args = (i,) if mode == "each" else ()
                        t0 = clock()
                        fn(*args)
                        spent[side] += clock() - t0
                if r:
                    times[mode][op].append(spent[""])
                    times[mode]["raw_" + op].append(spent["raw_"])
            for side in (tier, raw):
                side.check()
                side.clear()
    return {mode: {phase: statistics.median(ts) for phase, ts in phases.items()} for mode, phases in times.items()}


def _rows(backend: str, size: int, count: int, t: dict[str, dict[str, float]]) -> list[RemoteBenchRow]:
    moved = size * count / GB
    return [RemoteBenchRow(backend, size, mode, moved / m["put"], moved / m["raw_put"], moved / m["get"],
                           moved / m["raw_get"]) for mode, m in t.items()]


def _bench_valkey(root: Path, config: RemoteBenchConfig) -> list[RemoteBenchRow]:
    from kvtier.tiers.valkey import ValkeyTier, ValkeyTierConfig

    server = ValkeyServer(root / "valkey").start()
    try:
        rows = []
        for size in config.sizes:
            tier = ValkeyTier(ValkeyTierConfig((server.address,), 4 * config.count * size + MIB,
                                               prefix="bench", timeout_s=30.0))
            try:
                t = _measure(_TierSide(tier, size, config.count), _RawValkey(server, size, config.count, 30.0),
                             config.count, config.rounds)
            finally:
                tier.close()
            rows += _rows("valkey", size, config.count, t)
        return rows
    finally:
        server.stop()


def _bench_mooncake(root: Path, config: RemoteBenchConfig) -> list[RemoteBenchRow]:
    from kvtier.tiers.mooncake import MooncakeTier, MooncakeTierConfig

    servers = MooncakeServers(root / "mooncake", segment_bytes=4 * config.count * max(config.sizes) + 64 * MIB)
    servers.start()
    try:
        rows = []
        for size in config.sizes:
            tier = MooncakeTier(MooncakeTierConfig(servers.master_address, 4 * config.count * size + MIB,
                                                   prefix="bench", timeout_s=30.0))
            raw = _RawMooncake(servers.master_address, size, config.count)
            try:
                t = _measure(_TierSide(tier, size, config.count), raw, config.count, config.rounds)
            finally:
                raw.close()
                tier.close()
            rows += _rows("mooncake", size, config.count, t)
        return rows
    finally:
        servers.stop()


def run_remote_bench(config: RemoteBenchConfig) -> RemoteBenchResult:
    """Start the servers, measure every backend and size, stop the servers (in every case)."""
    load = os.getloadavg()[0]
    rows: list[RemoteBenchRow] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-remote-bench-") as tmp:
        for backend in config.backends:
            bench = _bench_valkey if backend == "valkey" else _bench_mooncake
            rows += bench(Path(tmp), config)
    return RemoteBenchResult(tuple(rows), config, load)
