"""The main job: simulated users in multi-turn chats, each turn timed with kvtier and with a
full recompute, on the embedded default model (or any local model directory).

Every user shares one system prompt (so its chunks are stored once for all of them), opens with
a document of their own, and then asks questions in pairs (a question and a quick follow-up),
round after round, so histories grow to several thousand tokens. The host tier is sized below what all conversations need, so a user
returning after the others finds their history on SSD, and a follow-up finds it in DRAM.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoConfig

from kvtier.engines.default_model import SIZES, default_model_dir
from kvtier.engines.hf import EngineConfig, HFEngine, Message, kv_layout_for
from kvtier.store import StoreConfig
from kvtier.tiers.disk import DiskTierConfig
from kvtier.tiers.host import HostTierConfig

if TYPE_CHECKING:
    from kvtier.engines.vllm_chat import VLLMChat

WORDS = ["cache", "memory", "layer", "token", "prefix", "attention", "model", "request", "user", "session", "chunk", "disk", "host", "latency", "throughput", "budget", "history", "context", "window", "query", "answer", "system", "prompt", "reuse", "prefill", "decode", "batch", "engine", "store", "tier", "policy", "evict", "promote", "demote", "load", "save", "hit", "miss", "the", "a", "of", "to", "and", "in", "for", "on", "with", "by", "from", "as", "is", "are", "was", "be", "it", "that", "this", "which", "what", "how", "why"]


@dataclass(frozen=True)
class DemoConfig:
    model: str = "small"
    """A default model size (tiny, small) or a local model directory."""
    users: int = 3
    rounds: int = 3
    """Each round, every user sends a question and a follow-up (two turns)."""
    doc_chars: int = 2500
    """A document each user sends with their first question (their own long context)."""
    user_chars: int = 250
    """A question; follow-ups are a third of it."""
    system_chars: int = 600
    max_new_tokens: int = 8
    chunk_tokens: int = 256
    host_fraction: float = 0.35
    """Host tier size as a share of the KV of all final histories (below 1: SSD is used)."""
    disk_bytes: int = 4 << 30
    directory: str | None = None
    seed: int = 0
    engine: str = "transformers"
    """``transformers`` (kvtier's own adapter) or ``vllm`` (vLLM with the kvtier connector)."""

    def __post_init__(self) -> None:
        if self.engine not in ("transformers", "vllm"):
            raise ValueError(f"demo engine must be 'transformers' or 'vllm', got {self.engine!r}")
        for name in ("users", "rounds", "user_chars", "max_new_tokens", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"demo {name} must be positive, got {getattr(self, name)}")
        if not 0 < self.host_fraction:
            raise ValueError(f"demo host_fraction must be positive, got {self.host_fraction}")


@dataclass(frozen=True, slots=True)
class TurnRecord:
    user: int
    turn: int
    history_tokens: int
    hit_tokens: int
    tier: str
    """The slowest tier the hit touched (``disk`` if any chunk came from SSD)."""
    tier_tokens: dict[str, int]
    ttft_kvtier_s: float
    ttft_recompute_s: float
    same_tokens: bool
    max_logit_diff: float
    load_hidden: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        word = rng.choice(WORDS)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:chars]


def resolve_model(model: str) -> Path:
    if model in SIZES:
        return default_model_dir(model)
    path = Path(model)
    if not (path / "config.json").exists():
        raise ValueError(f"--model must be one of {sorted(SIZES)} or a model directory; got {model!r}")
    return path


def run_demo(config: DemoConfig, on_turn: Callable[[TurnRecord, int], None] | None = None) -> list[TurnRecord]:
    """Run the demo; ``on_turn(record, total_turns)`` is called after every turn."""
    model_dir = resolve_model(config.model)
    rng = random.Random(config.seed)
    system = _text(rng, config.system_chars)
    turns_per_user = 2 * config.rounds
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-", dir=config.directory) as workdir:
        layout = kv_layout_for(AutoConfig.from_pretrained(model_dir), config.chunk_tokens)
        final_tokens = (config.system_chars + config.doc_chars
                        + turns_per_user * (config.user_chars + config.max_new_tokens + 16))
        host_bytes = max(
            layout.chunk_bytes * 2,
            int(config.host_fraction * config.users * layout.bytes_for_tokens(final_tokens)),
        )
        engine: HFEngine | VLLMChat
        if config.engine == "vllm":
            from kvtier.engines.vllm_chat import VLLMChat

            store = StoreConfig(model="-", layout=layout, host=HostTierConfig(host_bytes),
                                disk=DiskTierConfig(workdir, config.disk_bytes))
            engine = VLLMChat(model_dir, store, config.max_new_tokens,
                              max_model_len=final_tokens + 1024)
        else:
            engine = HFEngine.open(
                model_dir, host_bytes=host_bytes, disk_path=workdir, disk_bytes=config.disk_bytes,
                chunk_tokens=config.chunk_tokens,
                config=EngineConfig(max_new_tokens=config.max_new_tokens),
            )
        histories: list[list[Message]] = [[{"role": "system", "content": system}] for _ in range(config.users)]
        records: list[TurnRecord] = []
        total = config.users * turns_per_user
        try:
            for rnd in range(config.rounds):
                for user in range(config.users):
                    for k in range(2):
                        turn = 2 * rnd + k
                        chars = config.user_chars if k == 0 else max(1, config.user_chars // 3)
                        content = _text(rng, chars)
                        if turn == 0:
                            content = _text(rng, config.doc_chars) + "\n\n" + content
                        history = histories[user]
                        history.append({"role": "user", "content": content})
                        base = engine.generate(history, use_store=False)
                        # The user reads the last reply before typing: its save has had time.
                        # (Untimed here so the timing does not depend on thread scheduling.)
                        engine.wait_for_saves()
                        got = engine.generate(history)
                        history.append({"role": "assistant", "content": got.text})
                        rec = TurnRecord(
                            user=user, turn=turn, history_tokens=got.prompt_tokens,
                            hit_tokens=got.hit_tokens, tier=got.tier, tier_tokens=got.tier_tokens,
                            ttft_kvtier_s=got.ttft_s, ttft_recompute_s=base.ttft_s,
                            same_tokens=got.token_ids == base.token_ids,
                            max_logit_diff=float((got.first_logits - base.first_logits).abs().max()),
                            load_hidden=got.load_hidden,
                        )
                        records.append(rec)
                        if on_turn is not None:
                            on_turn(rec, total)
        finally:
            engine.close()
    return records


def summarize(records: list[TurnRecord], min_history: int = 4096) -> dict[str, dict[str, float]]:
    """Mean TTFT ratio (kvtier / recompute) per tier, over turns with at least ``min_history``."""
    out: dict[str, dict[str, float]] = {}
    for tier in sorted({r.tier for r in records}):
        rows = [r for r in records if r.tier == tier and r.history_tokens >= min_history]
        if rows:
            out[tier] = {
                "turns": len(rows),
                "ttft_kvtier_s": sum(r.ttft_kvtier_s for r in rows) / len(rows),
                "ttft_recompute_s": sum(r.ttft_recompute_s for r in rows) / len(rows),
                "ratio": sum(r.ttft_kvtier_s / r.ttft_recompute_s for r in rows) / len(rows),
                "load_hidden": sum(r.load_hidden for r in rows) / len(rows),
            }
    return out


def plot(records: list[TurnRecord], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for user in sorted({r.user for r in records}):
        rows = [r for r in records if r.user == user]
        x = [r.turn for r in rows]
        ax.plot(x, [r.ttft_recompute_s for r in rows], "o--", color=f"C{user}", alpha=0.6,
                label=f"user {user}: full recompute")
        ax.plot(x, [r.ttft_kvtier_s for r in rows], "s-", color=f"C{user}",
                label=f"user {user}: kvtier")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("TTFT per turn: kvtier vs full recompute")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
