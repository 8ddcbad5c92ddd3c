"""The embedded default model: a Llama-architecture LM with deterministic random weights.

No model can be downloaded where kvtier is developed and tested, so kvtier builds its own: a
character-level tokenizer (printable ASCII and newline, plus Llama-3 style special tokens and
chat template) and a ``LlamaForCausalLM`` whose weights come from a fixed seed. The directory is
an ordinary Hugging Face model directory, built once and cached under ``$KVTIER_HOME/models``
(default ``~/.cache/kvtier/models``); any local model directory can be used instead.

Sizes: ``tiny`` for tests (fast, 2 layers), ``mini`` (another fast shape, for tests of two
models side by side) and ``small`` (about 100M parameters) whose prefill cost is realistic
enough for benchmarks.

Every token decodes to text that encodes back to the same token, so a generated reply, rendered
into the next turn's history, hits the KV saved for it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from kvtier.core.home import kvtier_home

BUILD_VERSION = 2
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<unk>",
]
CHARS = ["\n"] + [chr(c) for c in range(0x20, 0x7F)]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

SIZES: dict[str, dict[str, int | float]] = {
    # head_dim 32: the smallest vLLM's CPU attention supports
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32,
    ),
    # another shape, for a second model beside ``tiny`` (one daemon serving two models)
    "mini": dict(
        hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=32,
    ),
    "small": dict(
        hidden_size=768, intermediate_size=2560, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64,
    ),
}

_build_lock = threading.Lock()


def models_home() -> Path:
    return kvtier_home() / "models"


def build_tokenizer():  # type: ignore[no-untyped-def]
    """The character-level tokenizer, built deterministically (no files needed)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        unk_token="<unk>",
        pad_token="<|end_of_text|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def default_model_dir(size: str = "tiny", home: str | os.PathLike[str] | None = None) -> Path:
    """Path of the default model of ``size``, building it on first use (atomically)."""
    if size not in SIZES:
        raise ValueError(f"unknown default model size {size!r}; choose one of {sorted(SIZES)}")
    root = Path(home) / "models" if home is not None else models_home()
    return build_once(root / f"kvtier-llama-{size}-v{BUILD_VERSION}", "config.json",
                      lambda path: _build(size, path))


def build_once(target: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """``target``, made by ``build`` (given an empty directory) unless its ``marker`` file is
    already there: the build goes to a temporary directory beside it, renamed into place only
    when complete, so a failed build leaves nothing behind and builds racing in several
    threads or processes leave one whole directory."""
    if (target / marker).exists():
        return target
    root = target.parent
    with _build_lock:
        if (target / marker).exists():
            return target
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create the model cache directory {root}: {exc}") from exc
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            build(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / marker).exists():  # another process won the race
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(size: str, path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=16384,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SIZES[size],
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.default_generator.manual_seed(1234 + BUILD_VERSION)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "kvtier.json").write_text(json.dumps({"size": size, "build_version": BUILD_VERSION}))
