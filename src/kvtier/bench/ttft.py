"""Time to first token by history length and tier: the engine target's benchmark.

For each history length, a conversation of that many tokens is continued by ``new_tokens`` new
ones (a follow-up turn), and its time to first token is measured three ways in one process:

- ``recompute``: the whole prompt is prefilled (the engine without kvtier);
- ``host``: the history's KV is in kvtier's DRAM tier;
- ``disk``: the history's KV is on SSD only: the store is reopened with an empty DRAM tier on
  the same directory (as after a restart), and reads go to the disk with ``O_DIRECT``.

Every run also checks that the generated token and its logits match the recompute. Each figure
is the median of ``repeats`` runs.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass

from transformers import AutoConfig

from kvtier.demo import resolve_model
from kvtier.engines.hf import EngineConfig, HFEngine, kv_layout_for, model_fingerprint
from kvtier.store import KVStore, StoreConfig
from kvtier.tiers.disk import DiskTierConfig
from kvtier.tiers.host import HostTierConfig


@dataclass(frozen=True)
class TTFTBenchConfig:
    model: str = "small"
    histories: tuple[int, ...] = (1024, 2048, 4096, 8192)
    new_tokens: int = 128
    chunk_tokens: int = 256
    repeats: int = 3
    directory: str | None = None

    def __post_init__(self) -> None:
        if not self.histories or any(h < self.chunk_tokens for h in self.histories):
            raise ValueError(f"history lengths must be at least one chunk ({self.chunk_tokens})")
        if self.new_tokens <= 0 or self.repeats <= 0:
            raise ValueError("new_tokens and repeats must be positive")


@dataclass(frozen=True, slots=True)
class TTFTRow:
    history_tokens: int
    new_tokens: int
    hit_tokens_host: int
    hit_tokens_disk: int
    ttft_recompute_s: float
    ttft_host_s: float
    ttft_disk_s: float
    host_ratio: float
    disk_ratio: float
    load_hidden_host: float
    load_hidden_disk: float
    same_output: bool
    max_logit_diff: float

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
    rows: list[TTFTRow] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-", dir=config.directory) as workdir:

        def store() -> KVStore:
            return KVStore(StoreConfig(
                model=fingerprint, layout=layout, host=HostTierConfig(host_bytes),
                disk=DiskTierConfig(workdir, disk_bytes), write_through=True,
            ))

        engine = HFEngine(model_dir, store(), EngineConfig(max_new_tokens=1, async_save=False))
        model, tokenizer = engine.model, engine.tokenizer
        engine.generate(prompt_ids=_prompt(256, 8, 99)[1], use_store=False)  # warm-up
        for salt, history in enumerate(config.histories):
            hist, prompt = _prompt(history, config.new_tokens, salt)
            base = [engine.generate(prompt_ids=prompt, use_store=False) for _ in range(config.repeats)]
            engine.generate(prompt_ids=hist + prompt[history : history + 1])  # saves the history
            host = [engine.generate(prompt_ids=prompt) for _ in range(config.repeats)]
            disk = []
            for _ in range(config.repeats):
                # the DRAM tier empty, the SSD tier as left: every hit is read from disk
                engine.close()
                engine = HFEngine(model_dir, store(), EngineConfig(max_new_tokens=1, async_save=False),
                                  model=model, tokenizer=tokenizer)
                disk.append(engine.generate(prompt_ids=prompt))
            ref = base[0]
            runs = host + disk
            t_base = statistics.median(r.ttft_s for r in base)
            t_host = statistics.median(r.ttft_s for r in host)
            t_disk = statistics.median(r.ttft_s for r in disk)
            rows.append(TTFTRow(
                history_tokens=history, new_tokens=config.new_tokens,
                hit_tokens_host=host[0].hit_tokens, hit_tokens_disk=disk[0].hit_tokens,
                ttft_recompute_s=t_base, ttft_host_s=t_host, ttft_disk_s=t_disk,
                host_ratio=t_host / t_base, disk_ratio=t_disk / t_base,
                load_hidden_host=statistics.median(r.load_hidden for r in host),
                load_hidden_disk=statistics.median(r.load_hidden for r in disk),
                same_output=all(r.token_ids == ref.token_ids for r in runs),
                max_logit_diff=max(float((r.first_logits - ref.first_logits).abs().max()) for r in runs),
            ))
        engine.close()
    return rows
