"""The configuration of the daemon load test (:mod:`kvtier.bench.daemon_load`): its load, the
daemon's tiers, the conversations' shape, and the layout of their KV."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvtier.core.layout import KVLayout


@dataclass(frozen=True)
class DaemonBenchConfig:
    seconds: float = 120.0
    """Length of the loaded phase (workers, storm and probe running)."""
    workers: int = 3
    dram_chunks: int = 48
    """DRAM of the daemon, in chunks of the layout below."""
    kill_every_s: float = 20.0
    """SIGKILL a worker (and start another) this often; 0: never."""
    idle_seconds: float = 10.0
    """Probe lookups on the idle daemon, before the load starts."""
    storm: bool = True
    """Run the prefetch storm (off: the load is the workers alone, for comparison)."""
    storm_rate: float = 0.0
    """Prefetch requests a second of the storm; 0: as fast as it can."""
    probe_interval_ms: float = 1.0
    """The probe starts one lookup this often (a late one starts at once, none is skipped up)."""
    think_ms: float = 0.0
    """A worker sleeps this long after each step (an engine computing between calls)."""
    client_nice: int = 0
    """Niceness of the workers and the storm (the daemon and the probe keep the default): on a
    machine with fewer cores than busy processes, so that the probe measures the daemon rather
    than the CPU scheduler."""
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    chunk_tokens: int = 16
    system_tokens: int = 32
    """The system prompt every conversation starts with (its chunks are shared)."""
    max_tokens: int = 320
    """A conversation ends (and only gets revisited) at this length."""
    turn_tokens: int = 40
    """Mean tokens a turn adds (drawn from [turn_tokens / 2, 3 * turn_tokens / 2])."""
    probe_tokens: int = 256
    active: int = 4
    """Conversations a worker keeps going at once."""
    revisit: float = 0.25
    """Share of a worker's steps that reload an old conversation instead of a turn."""
    disk_bytes: int = 512 << 20
    directory: str | None = None
    """Parent of the temporary directory (socket, SSD tier, daemon log). Default: $TMPDIR."""
    settle_s: float = 10.0
    """How long pins and reservations may take to drain after the workers stop."""
    flush_s: float = 60.0
    """How long the daemon may take to finish its queued background work after the load."""
    audit: int = 64
    """Conversations loaded and checked once more after the run."""
    seed: int = 0

    def __post_init__(self) -> None:
        def positive(name: str, kind: type = int, zero: bool = False) -> None:
            value = getattr(self, name)
            ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
            if ok and kind is float:
                ok = math.isfinite(value)
            if not ok or value < 0 or (value == 0 and not zero):
                what = "a number" if kind is float else "an int"
                raise ValueError(f"{name} must be {what} {'>= 0' if zero else '> 0'}, got {value!r}")

        for name in ("seconds", "idle_seconds", "probe_interval_ms", "settle_s", "flush_s"):
            positive(name, float)
        for name in ("kill_every_s", "storm_rate", "think_ms"):
            positive(name, float, zero=True)
        for name in ("workers", "dram_chunks", "num_layers", "num_kv_heads", "head_dim", "chunk_tokens",
                     "max_tokens", "turn_tokens", "probe_tokens", "active", "disk_bytes"):
            positive(name)
        for name in ("system_tokens", "audit", "seed", "client_nice"):
            positive(name, zero=True)
        if not isinstance(self.storm, bool):
            raise ValueError(f"storm must be true or false, got {self.storm!r}")
        if self.client_nice > 19:
            raise ValueError(f"client_nice must be in [0, 19], got {self.client_nice}")
        if self.workers > 64:
            raise ValueError(f"workers must be at most 64, got {self.workers}")
        if self.dram_chunks < 8:
            raise ValueError(f"dram_chunks must be at least 8 (a daemon needs room for a few pins "
                             f"and writes at once), got {self.dram_chunks}")
        if not isinstance(self.revisit, (int, float)) or not 0 <= self.revisit < 1:
            raise ValueError(f"revisit must be a share in [0, 1), got {self.revisit!r}")
        c = self.chunk_tokens
        if self.system_tokens >= self.max_tokens:
            raise ValueError(f"system_tokens ({self.system_tokens}) must be below max_tokens "
                             f"({self.max_tokens})")
        if self.max_tokens < 2 * c or self.probe_tokens < c:
            raise ValueError(f"max_tokens ({self.max_tokens}) must hold two chunks and probe_tokens "
                             f"({self.probe_tokens}) one, of {c} tokens")
        if self.turn_tokens < 2:
            raise ValueError(f"turn_tokens must be at least 2, got {self.turn_tokens}")
        if self.probe_tokens > self.max_tokens:
            raise ValueError(f"probe_tokens ({self.probe_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        if self.max_tokens // c > self.dram_chunks // 2:
            raise ValueError(f"a conversation of max_tokens ({self.max_tokens}) is "
                             f"{self.max_tokens // c} chunks: dram_chunks ({self.dram_chunks}) must "
                             "hold at least two of them")
        if self.disk_bytes < 4 * self.dram_chunks * self.layout.chunk_bytes:
            raise ValueError(f"disk_bytes ({self.disk_bytes}) must be at least 4x the DRAM tier "
                             f"({self.dram_chunks * self.layout.chunk_bytes} bytes)")
        if self.directory is not None and not os.path.isdir(self.directory):
            raise ValueError(f"directory {self.directory!r} is not a directory")

    @property
    def layout(self) -> KVLayout:
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype="float32", chunk_tokens=self.chunk_tokens)

    @property
    def host_bytes(self) -> int:
        return self.dram_chunks * self.layout.chunk_bytes

    @property
    def max_instances(self) -> int:
        """Worker processes the run may start: the first ones, the replacements of killed ones,
        and room for replacing some that crashed."""
        kills = math.ceil(self.seconds / self.kill_every_s) + 1 if self.kill_every_s else 0
        return self.workers + kills + 16
