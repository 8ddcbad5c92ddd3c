"""Model fingerprints: the model part of every chunk key, cheap enough for every process.

    model_fingerprint("/models/SmolLM2-135M-Instruct")       # a local directory
    model_fingerprint("HuggingFaceTB/SmolLM2-135M-Instruct")  # from the local HF cache only
    model_fingerprint("HuggingFaceTB/SmolLM2-135M-Instruct@main")

The result is ``f"{name}@{16 hex}"``: ``name`` is the directory's (or the hub repo's) last path
component, the hash (xxh3_128) covers what decides the KV a model computes for given token ids:
``config.json`` and the other top-level ``*.json`` files (tokenizer and generation settings
excluded), every ``*.safetensors`` file's name, size, header (dtypes, shapes, offsets) and the
first and last MiB of its tensor data, and every ``*.bin``/``*.pt``/``*.pth``/``*.gguf`` file's
name, size, first and last MiB. Weights are never read in full (about 2 MiB per file), so a vLLM
scheduler and each worker can afford it at start. The data samples are there for fine-tunes:
same shapes and sizes, other values; a change only in the middle of a large file goes unseen.

Guarantees: the same files give the same fingerprint wherever they lie (keys are shared across
machines; a hub snapshot and a local copy in a directory of the repo's name agree); a change to
the config, to any tensor's dtype, shape or offsets, or to any weight file's size changes it.
Symlinks are followed (hub snapshots point into ``blobs/``). Nothing here touches the network
or imports transformers or :mod:`kvtier.engines`.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import xxhash

__all__ = ["model_fingerprint", "resolve_model_dir"]

_SAMPLE = 1 << 20
"""Bytes hashed from each end of a weight file without a header to read."""
_MAX_HEADER = 100 << 20
"""The safetensors format's own limit on a header's size."""
_SAMPLED = (".bin", ".pt", ".pth", ".gguf")
_SKIPPED_JSON = frozenset({
    "generation_config.json", "kvtier.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "chat_template.json",
})
"""Files that change the text around token ids, never the KV of given ids."""
_COMMIT = re.compile(r"[0-9a-f]{40}")


def model_fingerprint(model: str | os.PathLike[str]) -> str:
    """``name@hash`` of a model directory or a hub id (``org/name[@revision]``) in the local
    cache. Raises ``ValueError`` for a model that cannot be found, a directory without
    ``config.json`` or a safetensors file whose header is damaged."""
    root, name = resolve_model_dir(model)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} is not a model directory (no config.json)")
    h = xxhash.xxh3_128()
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        if path.suffix == ".json" and not _skipped(path.name):
            _feed(h, b"json", path.name.encode(), path.read_bytes())
        elif path.suffix == ".safetensors":
            header = _safetensors_header(path)
            _feed(h, b"safetensors", path.name.encode(), _size(path), header, *_ends(path, len(header)))
        elif path.suffix in _SAMPLED:
            _feed(h, b"sampled", path.name.encode(), _size(path), *_ends(path, 0))
    return f"{name}@{h.hexdigest()[:16]}"


def resolve_model_dir(model: str | os.PathLike[str]) -> tuple[Path, str]:
    """The directory holding ``model``'s files and the name its fingerprint carries. A path to
    an existing directory wins over a hub id; a hub id is looked up only in the local cache
    (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``)."""
    path = Path(model)
    if path.is_dir():
        return path, Path(os.path.abspath(path)).name
    text = os.fspath(model)
    repo_id, _, revision = text.partition("@")
    cache = _hub_cache()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = _snapshot(repo, revision or "main") if repo_id else None
    if snapshot is None:
        raise ValueError(
            f"{text!r} is neither a directory nor in the local Hugging Face cache "
            f"(looked for revision {revision or 'main'!r} in {repo})"
        )
    return snapshot, repo_id.rsplit("/", 1)[-1]


def _hub_cache() -> Path:
    """The hub cache directory, as huggingface_hub picks it, read at call time."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _snapshot(repo: Path, revision: str) -> Path | None:
    """``snapshots/<commit>`` for a branch or tag (via ``refs/``) or a commit hash, if cached."""
    commit = revision
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    elif not _COMMIT.fullmatch(revision):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _skipped(name: str) -> bool:
    return name.startswith("tokenizer") or name in _SKIPPED_JSON


def _feed(h: xxhash.xxh3_128, *parts: bytes) -> None:
    """Length-prefixed, so no two different sequences of parts hash the same stream."""
    for part in parts:
        h.update(struct.pack("<Q", len(part)))
        h.update(part)


def _size(path: Path) -> bytes:
    return struct.pack("<Q", path.stat().st_size)


def _safetensors_header(path: Path) -> bytes:
    """The 8-byte length and the JSON header: dtypes, shapes and offsets of every tensor."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (0,)
        if not 2 <= length <= min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file (header length {length}, size {size})")
        header = f.read(length)
    try:
        if not isinstance(json.loads(header), dict):
            raise ValueError("not an object")
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: damaged safetensors header ({e})") from None
    return raw + header


def _ends(path: Path, start: int) -> tuple[bytes, bytes]:
    """The first and last MiB after ``start`` (all of it, once, when shorter than two MiB)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(start)
        head = f.read(_SAMPLE)
        f.seek(max(start + _SAMPLE, size - _SAMPLE))
        return head, f.read(_SAMPLE)
