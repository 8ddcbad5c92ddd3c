"""Model fingerprints: the model part of every chunk key.

    model_fingerprint("/models/SmolLM2-135M-Instruct")       # a local directory
    model_fingerprint("HuggingFaceTB/SmolLM2-135M-Instruct")  # from the local HF cache only
    model_fingerprint("HuggingFaceTB/SmolLM2-135M-Instruct@main")

The result is ``f"{name}@{16 hex}"``: ``name`` is the directory's (or the hub repo's) last path
component, the hash (xxh3_128) covers what decides the KV a model computes for given token ids:
``config.json`` and the other top-level ``*.json`` files (tokenizer and generation settings
excluded), and every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
``*.gguf``) by its name and an xxh3_128 digest of *all* its bytes. Two checkpoints that differ
in a single byte anywhere in one weight file (a fine-tune of the same shapes) never share KV.

Reading every weight is paid once per file and machine: each file's digest is kept in
``$KVTIER_HOME/fingerprints/`` (default ``~/.cache/kvtier``; made ``0700``, and not used when
it is another user's or others may write it), one small JSON each, under the file's real path,
device, inode, size, modification time and change time (``st_ctime_ns``), and reused while all
of them match (every restart). Processes that start together (a vLLM scheduler and its
workers) take turns on a lock per file, so one reads the weights and the others reuse its
digest. xxh3 hashes
far faster than a disk reads, so the first start costs about one read of the weights, which the
engine is about to do anyway (and then finds them in the page cache).

Residual risk, stated: a file rewritten in place with its size, inode, mtime *and* ctime all
unchanged would keep its old digest. A write updates ctime and nothing but a change of the
system clock sets it back, so this takes a deliberate effort by someone who can already write
the weights; delete ``$KVTIER_HOME/fingerprints`` to hash again. A home that cannot be written
only costs the reuse (each process then hashes the weights itself).

Guarantees: the same files give the same fingerprint wherever they lie (keys are shared across
machines; a hub snapshot and a local copy in a directory of the repo's name agree); a change to
the config or to any byte of any weight file changes it. Symlinks are followed (hub snapshots
point into ``blobs/``). Nothing here touches the network or imports transformers, nor
:mod:`kvtier.engines` until :func:`model_directory` is asked for a model.

What a command that runs a model accepts (``kvtier serve MODEL``) is :func:`model_directory`'s:
kvtier's own model names (``smollm2``, the demo's, built on first use as the demo builds it;
``tiny``, ``mini``, ``small``), a directory, or a hub id in the local cache
(``HuggingFaceTB/SmolLM2-135M-Instruct`` falls back to ``smollm2`` when it is not there).
:func:`resolve_model_dir` -- fingerprints, the daemon's HTTP lookups -- never builds anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
import struct
import tempfile
import time
from pathlib import Path

import xxhash

from kvtier.core.home import kvtier_home

__all__ = ["file_digest", "fingerprint_cache_dir", "model_fingerprint", "resolve_model_dir"]

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_READ = 8 << 20
"""Bytes read at a time while hashing a weight file."""
_SKIPPED_JSON = frozenset({
    "generation_config.json", "kvtier.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "chat_template.json",
})
"""Files that change the text around token ids, never the KV of given ids."""
_COMMIT = re.compile(r"[0-9a-f]{40}")
_DIGEST_VERSION = 1
LOCK_WAIT_S = 600.0
"""How long a process waits for another that hashes the same weight file (then hashes it too)."""

log = logging.getLogger(__name__)


def model_fingerprint(model: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """``name@hash`` of a model directory or a hub id (``org/name[@revision]``) in the local
    cache. ``cache_dir``: where weight digests are kept (default ``$KVTIER_HOME/fingerprints``).
    Raises ``ValueError`` for a model that cannot be found, a directory without
    ``config.json`` or a weight file that cannot be read."""
    root, name = resolve_model_dir(model)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} is not a model directory (no config.json)")
    cache = Path(cache_dir) if cache_dir is not None else fingerprint_cache_dir()
    h = xxhash.xxh3_128()
    for path in sorted(p for p in root.iterdir() if p.is_file() or (p.is_symlink() and p.suffix in _WEIGHTS)):
        if path.suffix == ".json" and not _skipped(path.name):
            _feed(h, b"json", path.name.encode(), path.read_bytes())
        elif path.suffix in _WEIGHTS:
            _feed(h, b"weights", path.name.encode(), file_digest(path, cache))
    return f"{name}@{h.hexdigest()[:16]}"


def fingerprint_cache_dir() -> Path:
    """``$KVTIER_HOME/fingerprints`` (default ``~/.cache/kvtier/fingerprints``)."""
    return kvtier_home() / "fingerprints"


def file_digest(path: Path, cache: Path | None = None) -> bytes:
    """The xxh3_128 digest of all of ``path``'s bytes (16 bytes): reused from ``cache`` while
    the file's identity and times match what was recorded, else computed and recorded. Only a
    cache directory of this user that nobody else may write is used; processes hashing the same
    file at once (a scheduler and its workers) take turns on a lock, so one of them reads it."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read a weight file ({exc.strerror or exc})") from None
    ident = {"v": _DIGEST_VERSION, "path": real, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
             "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    cache = _private_dir(cache) if cache is not None else None
    if cache is None:
        return _hash_file(path, real)
    record = cache / f"{xxhash.xxh3_64_hexdigest(real.encode())}.json"
    lock = _lock(record.with_suffix(".lock"))
    try:
        digest = _recorded(record, ident)
        if digest is None:
            digest = _hash_file(path, real)
            after = os.stat(real)
            if (after.st_mtime_ns, after.st_ctime_ns, after.st_size) == (st.st_mtime_ns, st.st_ctime_ns, st.st_size):
                _record(record, ident | {"xxh3_128": digest.hex()})  # not changed while being read
        return digest
    finally:
        if lock is not None:
            os.close(lock)  # and with it the flock


def _hash_file(path: Path, real: str) -> bytes:
    h = xxhash.xxh3_128()
    try:
        with open(real, "rb") as f:
            while chunk := f.read(_READ):
                h.update(chunk)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read a weight file ({exc.strerror or exc})") from None
    return h.digest()


def _private_dir(cache: Path) -> Path | None:
    """``cache``, made (``0700``) if absent, when it is a directory of this user that no one
    else may write; else None (digests are then not reused: a record another user could write
    would let them give one checkpoint another's digest, and so its KV)."""
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(cache)
    except OSError as exc:
        _warn_once(f"cannot use {cache} for weight digests ({exc.strerror or exc}): weights are hashed each time")
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        _warn_once(f"{cache} is not a directory of this user that only it may write: weight digests are "
                   "not reused from it (hashed each time)")
        return None
    return cache


def _recorded(record: Path, ident: dict[str, object]) -> bytes | None:
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return None
        with os.fdopen(fd, "r") as f:
            fd = -1
            saved = json.loads(f.read())
    except (OSError, ValueError):
        return None  # unreadable or damaged: hash again
    finally:
        if fd >= 0:
            os.close(fd)
    if not isinstance(saved, dict) or {k: saved.get(k) for k in ident} != ident:
        return None
    try:
        digest = bytes.fromhex(str(saved.get("xxh3_128", "")))
    except ValueError:
        return None
    return digest if len(digest) == 16 else None


def _lock(path: Path) -> int | None:
    """An exclusive flock on ``path`` (its fd; closing it lets go), or None if it cannot be had
    within :data:`LOCK_WAIT_S` (a holder stuck on a hung filesystem or stopped must not stop
    every engine's start: this one then hashes the file itself)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                _warn_once(f"another process has hashed {path.stem} for over {LOCK_WAIT_S:g} s: hashing it here too")
                return None
            time.sleep(0.05)
        except OSError:
            os.close(fd)
            return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("kvtier: %s", message)


def _record(record: Path, entry: dict[str, object]) -> None:
    """Write ``entry`` atomically (a temporary file renamed over it); a failure only costs reuse."""
    try:
        fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, record)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        log.info("kvtier: cannot keep a weight digest in %s (%s): it is hashed again next time",
                 record.parent, exc.strerror or exc)


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
    if "\0" in revision or ".." in revision.split("/") or revision.startswith("/"):
        return None  # (a name of a branch or tag, never a path out of the repo)
    ref = repo / "refs" / revision
    if ref.is_file():
        with open(ref, "rb") as f:
            commit = f.read(64).decode("ascii", "replace").strip()
        if not _COMMIT.fullmatch(commit):
            return None
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
