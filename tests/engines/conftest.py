"""What the engine tests share: the tiny default model loaded once per module, engines with
stores sized in chunks, and chats that grow turn by turn."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvtier import DiskTierConfig, HostTierConfig, KVStore, StoreConfig
from kvtier.core.layout import KVLayout
from kvtier.engines import attention
from kvtier.engines.hf import (
    EngineConfig,
    HFEngine,
    Message,
    TurnResult,
    kv_layout_for,
    model_fingerprint,
)
from kvtier.tiers.disk_format import header_len_for

C = 16
"""Chunk tokens: small, so a chat of a few hundred tokens spans many chunks."""

SYSTEM = "You are a careful assistant who answers questions about caches and memory tiers. "
QUESTIONS = [
    "What does a prefix cache store, and why does it help a long chat?",
    "And when DRAM is full?",
    "How is a damaged chunk on the SSD detected before it reaches the model?",
    "Thanks. Summarise that in one line.",
]


@dataclass
class Tiny:
    path: Path
    model: torch.nn.Module
    tokenizer: object

    def layout(self, chunk_tokens: int = C) -> KVLayout:
        return kv_layout_for(self.model.config, chunk_tokens)

    def store(self, host_chunks: int, disk_path: Path | None = None, disk_chunks: int = 256) -> KVStore:
        layout = self.layout()
        disk = None
        if disk_path is not None:
            per_chunk = header_len_for(layout.num_layers) + layout.chunk_bytes
            disk = DiskTierConfig(str(disk_path), disk_chunks * per_chunk)
        return KVStore(StoreConfig(
            model=model_fingerprint(self.path), layout=layout,
            host=HostTierConfig(host_chunks * layout.chunk_bytes), disk=disk,
        ))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Tiny:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=attention.NAME
    )
    return Tiny(tiny_model_dir, model, tokenizer)


MakeEngine = Callable[..., HFEngine]


@pytest.fixture
def make_engine(tiny: Tiny) -> Iterator[MakeEngine]:
    """``make_engine(host_chunks, disk_path=None, **engine_config)``: an engine over a fresh
    store, sharing the module's model; closed (store included) at the end of the test."""
    made: list[HFEngine] = []

    def make(host_chunks: int = 256, disk_path: Path | None = None, **config: object) -> HFEngine:
        config.setdefault("max_new_tokens", 8)
        engine = HFEngine(
            tiny.path, tiny.store(host_chunks, disk_path), EngineConfig(**config),  # type: ignore[arg-type]
            model=tiny.model, tokenizer=tiny.tokenizer,
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@dataclass
class Turn:
    history: list[Message]
    """The messages sent (the reply not yet appended)."""
    got: TurnResult
    baseline: TurnResult
    """The same request fully recomputed (``use_store=False``)."""


def converse(
    engine: HFEngine,
    questions: list[str],
    *,
    system: str = SYSTEM,
    before_turn: Callable[[int, list[Message]], None] | None = None,
) -> list[Turn]:
    """A chat: each question is answered with kvtier and by a full recompute, the kvtier reply is
    appended to the history, and its save is waited for so the next turn's hit is deterministic."""
    history: list[Message] = [{"role": "system", "content": system}]
    turns: list[Turn] = []
    for i, question in enumerate(questions):
        history.append({"role": "user", "content": question})
        if before_turn is not None:
            before_turn(i, history)
        baseline = engine.generate(history, use_store=False)
        got = engine.generate(history)
        engine.wait_for_saves()
        turns.append(Turn(list(history), got, baseline))
        history.append({"role": "assistant", "content": got.text})
    return turns


def assert_same_as_recompute(got: TurnResult, baseline: TurnResult) -> None:
    assert got.token_ids == baseline.token_ids
    assert got.text == baseline.text
    assert torch.allclose(got.first_logits, baseline.first_logits, rtol=0, atol=1e-5), (
        float((got.first_logits - baseline.first_logits).abs().max())
    )


def saved_tokens(turn: TurnResult) -> int:
    """Tokens whose KV a finished turn leaves for the next one: the prompt and every generated
    token but the last (which was never fed back to the model)."""
    return turn.prompt_tokens + len(turn.token_ids) - 1


@contextlib.contextmanager
def prefill_lengths(model: torch.nn.Module) -> Iterator[list[int]]:
    """Record the number of input tokens of every forward call of ``model``."""
    seen: list[int] = []

    def hook(module, args, kwargs):  # type: ignore[no-untyped-def]
        seen.append(int(kwargs["input_ids"].shape[1]))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def chunk_file(disk_dir: Path, key: bytes) -> Path:
    """Where the disk tier keeps a chunk (``chunks/<2 hex>/<hex>.kvc``)."""
    name = key.hex()
    path = Path(disk_dir) / "chunks" / name[:2] / f"{name}.kvc"
    assert path.exists(), f"chunk file {path} not found"
    return path
