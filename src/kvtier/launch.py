"""One command for vLLM with kvtier: a store daemon and vLLM's OpenAI server wired to it.

:class:`ServeStack` starts, as child processes, ``kvtier store serve`` (socket in a private
temporary directory unless one is given), waits until it answers, then vLLM's OpenAI server
with a ``--kv-transfer-config`` that plugs in :class:`kvtier.engines.vllm.KVTierConnector`
(``kv_load_failure_policy = "recompute"``, the daemon's socket), and waits until its
``/health`` answers 200. Without a store (``StackConfig.store is None``) it runs vLLM alone,
the same way, which is what a benchmark compares against.

Order and failure contract:

- start: daemon first, vLLM second; if either fails to come up, whatever was started is
  stopped and :class:`ChildDied` (or :class:`StartTimeout`) names the child and ends with the
  tail of its log, then (``ChildDied``) the lines of the whole log that say why it exited
  (:func:`kvtier.launch_args.cause_lines`: a traceback's last line, ``ERROR`` records), which
  the tail of vLLM's log often lacks: its root cause is logged by the worker, before the
  engine core's and the API server's tracebacks that the tail holds;
- stop (``stop()``, leaving the ``with`` block, or the supervisor's own exit): vLLM first, then
  the daemon, each with SIGTERM, then SIGKILL to its whole process group after ``grace_s``
  (vLLM's engine-core and worker processes are in the API server's group);
- :meth:`ServeStack.wait` returns only by raising :class:`ChildDied` when a child exits; the
  caller then stops the rest.

Children run in their own sessions (a Ctrl-C at the terminal reaches only the supervisor, which
stops them in order) and get SIGTERM if the supervisor dies without stopping them (Linux's
parent-death signal). Their output goes to log files in the stack's work directory. The flags
and connector config handed to vLLM are :mod:`kvtier.launch_args`' (re-exported here).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from kvtier.errors import DaemonUnavailable, KVTierError
from kvtier.launch_args import (
    CONNECTOR_MODULE,
    HINT_MIDDLEWARE,
    OWNED_FLAGS,
    PROFILE_MODULE,
    cause_lines,
    kv_transfer_config,
    profiled,
    refuse_owned_flags,
)
from kvtier.server.client import StoreClient

log = logging.getLogger(__name__)

__all__ = ["CONNECTOR_MODULE", "LOG_TAIL_CHARS", "OWNED_FLAGS", "PROFILE_MODULE", "ChildDied", "ServeStack",
           "StackConfig", "StartTimeout", "StoreSpec", "VLLMSpec", "dying_with_parent", "kv_transfer_config",
           "profiled", "refuse_owned_flags"]

LOG_TAIL_CHARS = 3000


class ChildDied(KVTierError, RuntimeError):
    """A child process (``daemon`` or ``vllm``) exited; the message holds its log's tail, then
    ``causes``, the lines of its log that say why (None: those of the tail), unless the tail
    holds them all."""

    def __init__(self, name: str, returncode: int | None, log_tail: str,
                 causes: Sequence[str] | None = None) -> None:
        self.name = name
        self.returncode = returncode
        self.log_tail = log_tail
        self.causes = tuple(cause_lines(log_tail) if causes is None else causes)
        label = {"daemon": "the kvtier daemon", "vllm": "vLLM"}.get(name, name)
        shown = all(line in log_tail for line in self.causes)  # (a short log: the tail is all of it)
        why = "" if shown else "\n\nwhat its log says went wrong:" + "".join(f"\n  {c}" for c in self.causes)
        super().__init__(f"{label} exited (status {returncode}); the end of its log:\n{log_tail.rstrip()}{why}")


class StartTimeout(KVTierError, RuntimeError):
    """A child did not become ready in time (it was stopped)."""


@dataclass(frozen=True)
class StoreSpec:
    """The daemon's tiers and socket (``socket=None``: one in the stack's private directory)."""

    host_bytes: int = 16 << 30
    disk_path: str | None = None
    disk_bytes: int | None = None
    disk_codec: str = "none"
    """The SSD tier's codec (see :mod:`kvtier.tiers.codecs`; lossy unless ``none``)."""
    socket: str | None = None
    policy: str | None = None
    ready_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.host_bytes <= 0:
            raise ValueError(f"store host_bytes must be positive, got {self.host_bytes}")
        if (self.disk_path is None) != (self.disk_bytes is None):
            raise ValueError("store disk_path and disk_bytes go together (an SSD tier needs both)")
        if self.disk_bytes is not None and self.disk_bytes <= 0:
            raise ValueError(f"store disk_bytes must be positive, got {self.disk_bytes}")
        if self.disk_codec not in ("none", "fp8", "int8", "int4", "auto"):
            raise ValueError(f"store disk_codec must be none, fp8, int8, int4 or auto, got {self.disk_codec!r}")


@dataclass(frozen=True)
class VLLMSpec:
    """vLLM's OpenAI server: the model directory, where it listens, and any other flags."""

    model: str
    port: int = 8000
    host: str = "127.0.0.1"
    args: tuple[str, ...] = ()
    """More server flags, passed as given (``--kv-transfer-config`` and the flags above are
    the stack's: refused here)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to the server's environment (e.g. ``VLLM_CPU_OMP_THREADS_BIND``)."""
    chunk_tokens: int | None = None
    """The connector's chunk size (None: its default)."""
    load_async: bool = False
    """The connector's ``load_async``: load hits between steps (vLLM's async loading)."""
    ready_timeout_s: float = 900.0
    python: str | None = None
    """The Python that runs vLLM (None: this one); another environment's, for a peer's
    connector (the benchmarks)."""
    connector: Mapping[str, object] | None = None
    """Another connector's ``--kv-transfer-config``, for a stack without a store (a peer)."""
    profile_dir: str | None = None
    """Wrap the connector in the timing proxy (:mod:`kvtier.bench.peers.connector_profile`),
    which writes a line per engine step here."""
    profile_module: str = PROFILE_MODULE
    """The proxy's module as the server's Python imports it."""

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").exists():
            raise ValueError(f"vLLM model must be a model directory with a config.json, got {self.model!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"vLLM port must be 0-65535, got {self.port}")
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        refuse_owned_flags(self.args)
        if self.profile_dir is not None and not self.profile_dir:
            raise ValueError("profile_dir must be a directory path or None")


@dataclass(frozen=True)
class StackConfig:
    vllm: VLLMSpec
    store: StoreSpec | None = field(default_factory=StoreSpec)
    """None: vLLM alone, without kvtier."""
    workdir: str | None = None
    """Where logs (and the default socket) go; None: a private temporary directory, removed
    on stop."""
    grace_s: float = 20.0
    """How long a child may take to exit after SIGTERM before it is killed."""

    def __post_init__(self) -> None:
        if self.grace_s < 0:
            raise ValueError(f"grace_s must not be negative, got {self.grace_s}")
        if self.store is not None and self.vllm.connector is not None:
            raise ValueError("a stack with a kvtier store plugs in kvtier's connector; "
                             "VLLMSpec.connector is for a stack without one")


def dying_with_parent(argv: list[str], sig: str = "TERM") -> list[str]:
    """``argv`` under ``setpriv --pdeathsig SIG`` where util-linux has it: the child gets ``sig``
    if the thread that started it ends without stopping it (start a stack from a thread that
    outlives it: the main thread, in the CLI). A signal handler or ``preexec_fn`` cannot do
    this safely in a threaded parent. The benchmarks' servers use KILL: a crashed or killed
    test leaves none behind."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", sig, "--", *argv] if setpriv else argv


class _Child:
    """One child process in its own session, its output in ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                dying_with_parent(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.text()[-chars:]

    def died(self) -> ChildDied:
        text = self.text()
        return ChildDied(self.name, self.proc.returncode, text[-LOG_TAIL_CHARS:], cause_lines(text))

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL to the process group after ``grace_s``; whatever is left of
        the group (grandchildren) is killed once the leader is gone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _kvtier_argv() -> list[str]:
    return [sys.executable, "-c", "from kvtier.cli import main; main(prog_name='kvtier')"]


class ServeStack:
    """The daemon (optional) and vLLM's OpenAI server, started in order and stopped in reverse.

    ``with ServeStack(config) as stack: ...`` starts both (blocking until vLLM is healthy) and
    stops both on leaving. ``stack.url`` is the server's base URL (``http://host:port``),
    ``stack.socket`` the daemon's socket (None without a store)."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self._tmp: list[str] = []
        """Private directories this stack made (removed on stop)."""
        self.workdir = Path(config.workdir) if config.workdir else None
        self.socket: str | None = None
        self.daemon: _Child | None = None
        self.vllm: _Child | None = None

    @property
    def url(self) -> str:
        spec = self.config.vllm
        return f"http://{spec.host}:{spec.port}"

    def _private_dir(self) -> str:
        """A new private directory with a short path (a Unix socket path has ~100 bytes)."""
        path = tempfile.mkdtemp(prefix="kvtier-serve-")
        if len(path) > 80:
            os.rmdir(path)
            path = tempfile.mkdtemp(prefix="kvtier-serve-", dir="/tmp")
        self._tmp.append(path)
        return path

    # -- start -----------------------------------------------------------------------------
    def start(self) -> Self:
        if self.workdir is None:
            self.workdir = Path(self._private_dir())
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            if self.config.store is not None:
                self._start_daemon(self.config.store)
            self._start_vllm(self.config.vllm)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_daemon(self, spec: StoreSpec) -> None:
        assert self.workdir is not None
        self.socket = spec.socket or str(Path(self._private_dir()) / "kvtier.sock")
        argv = [*_kvtier_argv(), "store", "serve", "--socket", self.socket,
                "--host-bytes", str(spec.host_bytes)]
        if spec.disk_path is not None:
            argv += ["--disk-path", spec.disk_path, "--disk-bytes", str(spec.disk_bytes),
                     "--disk-codec", spec.disk_codec]
        if spec.policy is not None:
            argv += ["--policy", spec.policy]
        self.daemon = _Child("daemon", argv, self.workdir / "daemon.log")
        deadline = time.monotonic() + spec.ready_timeout_s
        while not self._daemon_answers():
            if self.daemon.poll() is not None:
                raise self.daemon.died()
            if time.monotonic() > deadline:
                raise StartTimeout(f"the kvtier daemon did not answer on {self.socket} within "
                                   f"{spec.ready_timeout_s:.0f} s; log:\n{self.daemon.tail()}")
            time.sleep(0.1)

    def _daemon_answers(self) -> bool:
        try:
            self.stats()
            return True
        except DaemonUnavailable:
            return False

    def _start_vllm(self, spec: VLLMSpec) -> None:
        assert self.workdir is not None
        argv = [spec.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", spec.model, "--host", spec.host, "--port", str(spec.port), *spec.args]
        connector = (kv_transfer_config(self.socket, spec.chunk_tokens, spec.load_async)
                     if self.socket is not None else dict(spec.connector) if spec.connector else None)
        if connector is not None and spec.profile_dir is not None:
            connector = profiled(connector, spec.profile_dir, spec.profile_module)
        if connector is not None:
            argv += ["--kv-transfer-config", json.dumps(connector)]
        if self.socket is not None:  # a malformed session hint: HTTP 400 naming its field
            argv += ["--middleware", HINT_MIDDLEWARE]
        self.vllm = _Child("vllm", argv, self.workdir / "vllm.log", env=spec.env)
        deadline = time.monotonic() + spec.ready_timeout_s
        while not self._healthy():
            self.check()
            if time.monotonic() > deadline:
                raise StartTimeout(f"vLLM was not healthy at {self.url}/health within "
                                   f"{spec.ready_timeout_s:.0f} s; log:\n{self.vllm.tail()}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    # -- while running ---------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`ChildDied` if the daemon or vLLM has exited (the daemon is checked
        first: vLLM going down after it lost its store names the cause)."""
        for child in (self.daemon, self.vllm):
            if child is not None and child.poll() is not None:
                raise child.died()

    def wait(self, poll_s: float = 0.5) -> None:
        """Block until a child exits; then raise :class:`ChildDied` naming it."""
        while True:
            self.check()
            time.sleep(poll_s)

    def stats(self) -> dict[str, object]:
        """The daemon's statistics snapshot (raises DaemonUnavailable; ValueError without one)."""
        if self.socket is None:
            raise ValueError("this stack runs no kvtier daemon")
        client = StoreClient(self.socket, timeout_s=5.0, retry_s=0.05)
        try:
            return client.stats()
        finally:
            client.close()

    def log_text(self, name: str) -> str:
        """The whole log of ``daemon`` or ``vllm`` (empty if that child never started)."""
        child = {"daemon": self.daemon, "vllm": self.vllm}[name]
        return child.log.read_text(errors="replace") if child is not None else ""

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop vLLM, then the daemon; idempotent. The private work directory is removed."""
        for child in (self.vllm, self.daemon):
            if child is not None:
                child.stop(self.config.grace_s)
        if self.daemon is not None and self.socket is not None:
            self._remove_dead_arena(self.socket)
        while self._tmp:
            shutil.rmtree(self._tmp.pop(), ignore_errors=True)

    @staticmethod
    def _remove_dead_arena(socket_path: str) -> None:
        """A daemon that was killed (SIGKILL, the OOM killer) leaves its arena in /dev/shm, its
        RAM held until reboot: claim its socket -- only possible once it is gone -- which
        removes the arena its lock file records, and let go."""
        from kvtier.server.runtime import SocketClaim

        try:
            SocketClaim(socket_path).release()
        except (ValueError, OSError) as exc:  # another daemon took the socket meanwhile: its own
            log.info("kvtier: left %s's arena in place (%s)", socket_path, exc)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
