"""The main job: simulated users in multi-turn chats, each turn timed with kvtier and with a
full recompute, on SmolLM2-135M-Instruct (:mod:`kvtier.engines.real_model`), an embedded
random-weight model or any local model directory.

Every user shares one system prompt (so its chunks are stored once for all of them), opens with
a document of their own, and then asks questions in pairs (a question and a quick follow-up),
round after round, so histories grow to thousands of tokens. The host tier is sized below what
all conversations need, so a user returning after the others finds their history on SSD, and a
follow-up finds it in DRAM.

A trained model gets readable English: a travel diary as the document and questions about it,
and its replies are worth reading (``on_reply``). kvtier's embedded models (random weights, a
character tokenizer) get random words of the requested lengths instead.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoConfig

from kvtier.engines.default_model import SIZES, default_model_dir
from kvtier.engines.hf import EngineConfig, HFEngine, Message, kv_layout_for
from kvtier.engines.real_model import NAME as REAL_MODEL
from kvtier.engines.real_model import real_model_dir
from kvtier.store import StoreConfig
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.host_config import HostTierConfig

if TYPE_CHECKING:
    from kvtier.engines.vllm_chat import VLLMChat

WORDS = ["cache", "memory", "layer", "token", "prefix", "attention", "model", "request", "user", "session", "chunk", "disk", "host", "latency", "throughput", "budget", "history", "context", "window", "query", "answer", "system", "prompt", "reuse", "prefill", "decode", "batch", "engine", "store", "tier", "policy", "evict", "promote", "demote", "load", "save", "hit", "miss", "the", "a", "of", "to", "and", "in", "for", "on", "with", "by", "from", "as", "is", "are", "was", "be", "it", "that", "this", "which", "what", "how", "why"]

# A trained model's material: a travel diary (one line a day) and questions about it.
CITIES = ["Paris", "Rome", "Tokyo", "Cairo", "Lima", "Oslo", "Lisbon", "Madrid", "Berlin",
          "Vienna", "Athens", "Dublin", "Nairobi", "Ottawa", "Bangkok", "Seoul", "Prague",
          "Warsaw", "Stockholm", "Sydney", "Istanbul", "Amsterdam", "Buenos Aires", "Mumbai"]
TRAVEL = ["by train", "by plane", "by bus", "by ferry", "by car", "on foot"]
EVENINGS = ["visiting a museum", "walking by the river", "eating at a small restaurant",
            "listening to a concert", "reading in the hotel garden", "shopping at a market"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "foggy"]
SYSTEM = "You are a helpful travel assistant. Answer every question in one short sentence."
QUESTIONS = ["Which country is {city} in?", "How did I travel to {city}?",
             "What did I do in the evening in {city}?", "What was the weather like in {city}?"]
FOLLOW_UPS = ["What is {city} famous for?", "Thanks. Which language do people speak there?",
              "Can you say that in one short sentence?"]


@dataclass(frozen=True)
class DemoConfig:
    model: str = REAL_MODEL
    """``smollm2`` (SmolLM2-135M-Instruct, trained), an embedded random-weight model size
    (tiny, small) or a local model directory."""
    users: int = 3
    rounds: int = 3
    """Each round, every user sends a question and a follow-up (two turns)."""
    doc_chars: int = 2500
    """A document each user sends with their first question (their own long context)."""
    user_chars: int = 250
    """A question of random words; follow-ups are a third of it. (A trained model is asked
    real questions, whatever their length.)"""
    system_chars: int = 600
    """The random words' system prompt (a trained model gets a real one)."""
    max_new_tokens: int = 24
    """Tokens a reply may take (a trained model's replies are printed: long enough to read)."""
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


@dataclass(frozen=True, slots=True)
class Reply:
    """What a user asked (without the document) and what a trained model answered."""
    user: int
    turn: int
    question: str
    text: str


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        word = rng.choice(WORDS)
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:chars]


class _Chats:
    """What the users say: a diary and questions about it for a trained model, random words of
    the configured lengths for an embedded one. ``say`` returns (message, question)."""

    def __init__(self, config: DemoConfig, trained: bool, rng: random.Random) -> None:
        self.config, self.trained, self.rng = config, trained, rng
        self.system = SYSTEM if trained else _text(rng, config.system_chars)
        self.cities: dict[int, list[str]] = {}
        self.city: dict[int, str] = {}

    def say(self, user: int, turn: int) -> tuple[str, str]:
        rng, config = self.rng, self.config
        if not self.trained:
            chars = config.user_chars if turn % 2 == 0 else max(1, config.user_chars // 3)
            question = _text(rng, chars)
            return (_text(rng, config.doc_chars) + "\n\n" + question if turn == 0 else question), question
        doc = self._diary(user) if turn == 0 else ""
        if turn % 2 == 0:
            self.city[user] = rng.choice(self.cities.get(user) or CITIES)
        question = rng.choice(QUESTIONS if turn % 2 == 0 else FOLLOW_UPS).format(city=self.city[user])
        return (f"Here is my travel diary.\n\n{doc}\n\n{question}" if doc else question), question

    def _diary(self, user: int) -> str:
        """About ``doc_chars`` characters, a line a day; every city once before any repeats."""
        rng = self.rng
        lines: list[str] = []
        cities: list[str] = []
        order: list[str] = []
        size = 0
        while size < self.config.doc_chars:
            if not order:
                order = rng.sample(CITIES, len(CITIES))
            cities.append(order.pop())
            lines.append(_day(len(cities), cities[-1], rng.choice(TRAVEL), rng.choice(WEATHER),
                              rng.choice(EVENINGS)))
            size += len(lines[-1]) + 1
        self.cities[user] = cities
        return "\n".join(lines)


def _day(day: int, city: str, travel: str, weather: str, evening: str) -> str:
    return (f"Day {day}: I arrived in {city} {travel}. The weather was {weather}, and I spent the "
            f"evening {evening}.")


MODELS: dict[str, Callable[[], Path]] = {
    **{size: partial(default_model_dir, size) for size in SIZES}, REAL_MODEL: real_model_dir,
}
"""The names ``--model`` accepts besides a directory, each with the function that builds it."""


def resolve_model(model: str) -> Path:
    """The directory of a model name (:data:`MODELS`, built on first use) or a model directory.
    Raises ``ValueError`` for anything else, or when the named model cannot be built."""
    if model in MODELS:
        return MODELS[model]()
    path = Path(model)
    if not (path / "config.json").exists():
        raise ValueError(f"--model must be one of {sorted(MODELS)} or a model directory; got {model!r}")
    return path


def is_trained(model_dir: Path) -> bool:
    """False for kvtier's embedded random-weight models (their ``kvtier.json`` names a size)."""
    try:
        marker = json.loads((model_dir / "kvtier.json").read_text())
    except (OSError, ValueError):
        return True
    return not (isinstance(marker, dict) and "size" in marker)


def _final_tokens(model_dir: Path, chats: _Chats, config: DemoConfig) -> int:
    """An estimate of the longest history, in tokens: its characters (one token each with the
    embedded models' tokenizer; a trained model's tokenizer is measured on diary lines) plus
    each turn's reply and template."""
    per_char = 1.0
    question_chars = config.user_chars
    if chats.trained:
        from transformers import AutoTokenizer

        sample = " ".join(_day(d, c, TRAVEL[d % len(TRAVEL)], WEATHER[d % len(WEATHER)],
                               EVENINGS[d % len(EVENINGS)]) for d, c in enumerate(CITIES))
        per_char = len(AutoTokenizer.from_pretrained(model_dir).encode(sample)) / len(sample)
        question_chars = max(len(q) for q in QUESTIONS + FOLLOW_UPS) + 10
    chars = len(chats.system) + config.doc_chars + 2 * config.rounds * question_chars
    return int(per_char * chars) + 2 * config.rounds * (config.max_new_tokens + 16)


def run_demo(config: DemoConfig, on_turn: Callable[[TurnRecord, int], None] | None = None,
             on_reply: Callable[[Reply], None] | None = None) -> list[TurnRecord]:
    """Run the demo; ``on_turn(record, total_turns)`` is called after every turn and, for a
    trained model, ``on_reply(reply)`` after it (an embedded model's replies are noise)."""
    model_dir = resolve_model(config.model)
    rng = random.Random(config.seed)
    chats = _Chats(config, is_trained(model_dir), rng)
    turns_per_user = 2 * config.rounds
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-", dir=config.directory) as workdir:
        layout = kv_layout_for(AutoConfig.from_pretrained(model_dir), config.chunk_tokens)
        final_tokens = _final_tokens(model_dir, chats, config)
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
        histories: list[list[Message]] = [[{"role": "system", "content": chats.system}]
                                          for _ in range(config.users)]
        records: list[TurnRecord] = []
        total = config.users * turns_per_user
        try:
            for rnd in range(config.rounds):
                for user in range(config.users):
                    for k in range(2):
                        turn = 2 * rnd + k
                        content, question = chats.say(user, turn)
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
                        if on_reply is not None and chats.trained:
                            on_reply(Reply(user, turn, question, got.text))
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
