"""The configuration of one trace replay (:mod:`kvtier.bench.replay`): the policy, the tiers'
capacities and read rates, the SSD codec, the compute model and how requests arrive."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.bench.simstore import SimConfig
from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS
from kvtier.core.cost_model import ComputeModel
from kvtier.core.layout import KVLayout
from kvtier.core.policy import POLICIES

LLAMA3_8B_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                            chunk_tokens=MOONCAKE_BLOCK_TOKENS)


@dataclass(frozen=True)
class ReplayConfig:
    """One replay: a policy, tier capacities in blocks, the hardware and the model."""

    policy: str = "lru"
    dram_blocks: int = 4096
    ssd_blocks: int = 0
    """0: no SSD tier."""
    layout: KVLayout = LLAMA3_8B_LAYOUT
    dram_read_GBps: float = 20.0
    ssd_read_GBps: float = 5.0
    compute: ComputeModel = field(default_factory=ComputeModel)
    instances: int = 4
    ssd_codec: str = "none"
    """The SSD tier's codec (a label: its figures are the two below)."""
    ssd_codec_ratio: float = 1.0
    """Stored bytes over raw bytes of a block with that codec: the SSD holds ``ssd_blocks /
    ratio`` blocks (``ssd_blocks`` counts raw blocks' worth of bytes)."""
    ssd_decode_GBps: float = math.inf
    """Raw GB/s the codec decodes at: an SSD hit reads ``ratio`` of the bytes, then decodes."""
    layerwise: bool = False
    """Layer-wise loading (kvtier's and AttentionStore's): layer ``l+1``'s chunks load while
    layer ``l`` computes, so a request takes ``max(compute, load) + min(compute, load) /
    layers`` instead of their sum."""
    closed_loop: bool = False
    """On a trace that names sessions: a session's next turn arrives its ``think_s`` after the
    previous turn's reply is done (prefill, then decode), not at its own ``arrival_s``: behind
    a queue, a conversation then comes back later, as a user waits for each reply."""
    decode_s_per_token: float = 0.0
    """Server seconds each reply token takes (the decode steps' share of the server, which also
    decodes): a request holds its instance for its prefill plus ``output_length`` times this,
    and its reply is done at the end."""
    save_replies: bool = True
    """On a trace that names sessions: after a turn, also save the blocks its reply completes
    (named by the session's next prompt), as a store behind an engine that saves generated
    tokens does (kvtier's connector, AttentionStore). Without session ids only prompts are saved."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known policies: {list(POLICIES)}")
        if self.layout.chunk_tokens != MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"layout.chunk_tokens must be {MOONCAKE_BLOCK_TOKENS} (Mooncake blocks)")
        if not isinstance(self.instances, int) or self.instances <= 0:
            raise ValueError(f"instances must be a positive int, got {self.instances!r}")
        for name in ("dram_read_GBps", "ssd_read_GBps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.ssd_codec_ratio <= 1 or (self.ssd_codec == "none") != (self.ssd_codec_ratio == 1):
            raise ValueError(f"ssd_codec_ratio must be in (0, 1], and 1 exactly without a codec; "
                             f"got {self.ssd_codec_ratio!r} for codec {self.ssd_codec!r}")
        if not self.decode_s_per_token >= 0:
            raise ValueError(f"decode_s_per_token must be >= 0, got {self.decode_s_per_token!r}")
        if not self.ssd_decode_GBps > 0:
            raise ValueError(f"ssd_decode_GBps must be positive, got {self.ssd_decode_GBps!r}")
        SimConfig(self.policy, self.dram_blocks, self.ssd_blocks)  # validates capacities

    @property
    def ssd_blocks_held(self) -> int:
        """Blocks the SSD holds: its bytes over a block's stored size."""
        return int(self.ssd_blocks / self.ssd_codec_ratio + 1e-9)

    def load_s(self, level: int) -> float:
        if level == 0:
            return self.layout.chunk_bytes / (self.dram_read_GBps * 1e9)
        raw = self.layout.chunk_bytes
        return raw * self.ssd_codec_ratio / (self.ssd_read_GBps * 1e9) + raw / (self.ssd_decode_GBps * 1e9)
