"""Time to first token by history length and tier: the engine target's benchmark.

For each history length, a conversation of that many tokens is continued by ``new_tokens`` new
ones (a follow-up turn), and its time to first token is measured three ways in one process:

- ``recompute``: the whole prompt is prefilled (the engine without kvtier);
- ``host``: the history's KV is in kvtier's DRAM tier;
- ``disk``: the history's KV is on SSD only: the store is reopened with an empty DRAM tier on
  the same directory (as after a restart), and reads go to the disk with ``O_DIRECT``. With
  ``disk_codecs`` (default ``("none",)``) this is measured once per codec, each on an SSD tier of
  its own configured with that codec (the history written through it), so a lossy codec's SSD
  hits compare with raw ones in one process (``vs_first``: TTFT over the first codec's).

Every run also checks that the generated token and its logits match the recompute. A lossy
codec's KV is not the model's exactly: its runs report whether the greedy token matched and the
largest logit difference, and do not count against ``same_output``. Each figure is the median of
``repeats`` runs.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import asdict, dataclass

from transformers import AutoConfig

from kvtier.demo import resolve_model
from kvtier.engines.hf import EngineConfig, HFEngine, TurnResult, kv_layout_for, model_fingerprint
from kvtier.store import KVStore, StoreConfig
from kvtier.tiers.codec_types import check_codec
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.host_config import HostTierConfig


@dataclass(frozen=True)
class TTFTBenchConfig:
    model: str = "small"
    histories: tuple[int, ...] = (1024, 2048, 4096, 8192)
    new_tokens: int = 128
    chunk_tokens: int = 256
    repeats: int = 3
    directory: str | None = None
    disk_codecs: tuple[str, ...] = ("none",)
    """The SSD tier's codec for the ``disk`` runs, one set of runs each (see the module
    docstring)."""

    def __post_init__(self) -> None:
        if not self.histories or any(h < self.chunk_tokens for h in self.histories):
            raise ValueError(f"history lengths must be at least one chunk ({self.chunk_tokens})")
        if self.new_tokens <= 0 or self.repeats <= 0:
            raise ValueError("new_tokens and repeats must be positive")
        if not self.disk_codecs or len(set(self.disk_codecs)) != len(self.disk_codecs):
            raise ValueError(f"disk_codecs must name distinct codecs, got {self.disk_codecs!r}")
        for codec in self.disk_codecs:
            check_codec(codec, "ttft bench disk")


@dataclass(frozen=True, slots=True)
class DiskRun:
    """The SSD hits of one history with the SSD tier configured with ``codec``."""

    codec: str
    hit_tokens: int
    ttft_s: float
    ratio: float
    """TTFT over the recompute's."""
    vs_first: float
    """TTFT over the first codec's SSD hit."""
    load_hidden: float
    same_tokens: bool
    """Every run's generated token is the recompute's."""
    max_logit_diff: float
    stored_bytes: int
    """Bytes the history's chunks take in this codec's SSD tier (files, headers included)."""


@dataclass(frozen=True, slots=True)
class TTFTRow:
    history_tokens: int
    new_tokens: int
    hit_tokens_host: int
    ttft_recompute_s: float
    ttft_host_s: float
    host_ratio: float
    load_hidden_host: float
    disk: tuple[DiskRun, ...]
    """One per codec of ``disk_codecs``, in order."""
    same_output: bool
    """The DRAM hits and every lossless (``none``) SSD hit give the recompute's token."""
    max_logit_diff: float
    """Largest logit difference to the recompute over those runs."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _prompt(history: int, new: int, salt: int) -> tuple[list[int], list[int]]:
    # Printable-character ids of the default tokenizer's range; any ids work for other models.
    body = [7 + (i * 31 + salt * 17 + (i // 97)) % 90 for i in range(history + new)]
    return body[:history], body


def run_ttft_bench(config: TTFTBenchConfig) -> list[TTFTRow]:
    model_dir = resolve_model(config.model)
    layout = kv_layout_for(AutoConfig.from_pretrained(model_dir), config.chunk_tokens)
    longest = max(config.histories) + config.new_tokens
    host_bytes = layout.bytes_for_tokens(2 * longest) + 2 * layout.chunk_bytes
    disk_bytes = layout.bytes_for_tokens(sum(config.histories) * 2) + (64 << 20)
    fingerprint = model_fingerprint(model_dir)
    engine_config = EngineConfig(max_new_tokens=1, async_save=False)
    rows: list[TTFTRow] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-", dir=config.directory) as workdir:

        def store(codec: str) -> KVStore:
            return KVStore(StoreConfig(
                model=fingerprint, layout=layout, host=HostTierConfig(host_bytes),
                disk=DiskTierConfig(os.path.join(workdir, codec), disk_bytes, codec=codec),
                write_through=True,
            ))

        first = config.disk_codecs[0]
        engine = HFEngine(model_dir, store(first), engine_config)
        model, tokenizer = engine.model, engine.tokenizer

        def reopen(codec: str) -> HFEngine:
            engine.close()
            return HFEngine(model_dir, store(codec), engine_config, model=model, tokenizer=tokenizer)

        engine.generate(prompt_ids=_prompt(256, 8, 99)[1], use_store=False)  # warm-up
        for salt, history in enumerate(config.histories):
            hist, prompt = _prompt(history, config.new_tokens, salt)
            base = [engine.generate(prompt_ids=prompt, use_store=False) for _ in range(config.repeats)]
            ref = base[0]
            host: list[TurnResult] = []
            stored: dict[str, int] = {}
            for codec in config.disk_codecs:
                engine = reopen(codec)
                before = _disk_used(engine)
                engine.generate(prompt_ids=hist + prompt[history : history + 1])  # saves the history
                stored[codec] = _disk_used(engine) - before
                if codec == first:
                    host = [engine.generate(prompt_ids=prompt) for _ in range(config.repeats)]
            by_codec: dict[str, list[TurnResult]] = {codec: [] for codec in config.disk_codecs}
            for _ in range(config.repeats):
                for codec in config.disk_codecs:  # interleaved: a busy spell of the machine hits all
                    # the DRAM tier empty, the SSD tier as left: every hit is read from disk
                    engine = reopen(codec)
                    by_codec[codec].append(engine.generate(prompt_ids=prompt))
            t_base = statistics.median(r.ttft_s for r in base)
            t_first = statistics.median(r.ttft_s for r in by_codec[first])
            disk = tuple(_disk_run(codec, runs, ref, t_base, t_first, stored[codec])
                         for codec, runs in by_codec.items())
            exact = host + [r for codec, runs in by_codec.items() if codec == "none" for r in runs]
            t_host = statistics.median(r.ttft_s for r in host)
            rows.append(TTFTRow(
                history_tokens=history, new_tokens=config.new_tokens, hit_tokens_host=host[0].hit_tokens,
                ttft_recompute_s=t_base, ttft_host_s=t_host, host_ratio=t_host / t_base,
                load_hidden_host=statistics.median(r.load_hidden for r in host), disk=disk,
                same_output=all(r.token_ids == ref.token_ids for r in exact),
                max_logit_diff=_max_diff(exact, ref),
            ))
        engine.close()
    return rows


def _max_diff(runs: list[TurnResult], ref: TurnResult) -> float:
    return max((float((r.first_logits - ref.first_logits).abs().max()) for r in runs), default=0.0)


def _disk_run(codec: str, runs: list[TurnResult], ref: TurnResult, t_base: float, t_first: float,
              stored: int) -> DiskRun:
    t = statistics.median(r.ttft_s for r in runs)
    return DiskRun(
        codec=codec, hit_tokens=runs[0].hit_tokens, ttft_s=t, ratio=t / t_base, vs_first=t / t_first,
        load_hidden=statistics.median(r.load_hidden for r in runs),
        same_tokens=all(r.token_ids == ref.token_ids for r in runs), max_logit_diff=_max_diff(runs, ref),
        stored_bytes=stored,
    )


def _disk_used(engine: HFEngine) -> int:
    """Bytes the engine's SSD tier takes (files: headers, payloads, page padding)."""
    store = engine.store
    assert isinstance(store, KVStore)
    return next(t for t in store.tiers if t.name == "disk").used
