"""The store daemon of the load test (:mod:`kvtier.bench.daemon_load`): a ``kvtier store serve``
process started and stopped here, its ``/proc`` samples, its lookup histogram, and its log
with the warnings in it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvtier.bench.daemon_config import DaemonBenchConfig
from kvtier.bench.daemon_report import Sample

_ARENA = re.compile(r"kvtier-[0-9a-f]{32}")


def _kvtier_command() -> list[str]:
    script = Path(sys.executable).with_name("kvtier")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtier.cli"]


class _Daemon:
    def __init__(self, config: DaemonBenchConfig, tmp: str) -> None:
        self.socket = os.path.join(tmp, "kv.sock")
        if len(os.fsencode(self.socket)) > 100:
            raise ValueError(f"the socket path {self.socket} is too long for a Unix socket: "
                             "use a shorter directory")
        self.log = os.path.join(tmp, "daemon.log")
        self.cmd = [*_kvtier_command(), "store", "serve", "--socket", self.socket,
                    "--host-bytes", str(config.host_bytes), "--disk-path", os.path.join(tmp, "ssd"),
                    "--disk-bytes", str(config.disk_bytes), "--metrics-port", "0"]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.socket)
                return
            except OSError:
                time.sleep(0.05)
            finally:
                s.close()
        raise RuntimeError(f"the daemon did not listen on {self.socket} in {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def sample(self, t: float) -> Sample | None:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

        def kib(name: str) -> int:
            return int(fields.get(name, "0 kB").split()[0])

        return Sample(t, kib("RssAnon"), kib("VmRSS"), int(fields.get("Threads", "0")), fds)

    def log_text(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")
        except OSError:
            return ""

    def lookup_histogram(self) -> dict[float, float]:
        """The daemon's own histogram of lookup handling times (its Prometheus endpoint):
        upper bound in seconds -> lookups that took at most that long, since it started."""
        m = re.search(r"metrics on (http://\S+)", self.log_text())
        if m is None:
            return {}
        try:
            body = urllib.request.urlopen(m.group(1), timeout=10).read().decode()
        except OSError:
            return {}
        out: dict[float, float] = {}
        for line in body.splitlines():
            hit = re.fullmatch(r'kvtier_op_seconds_bucket\{le="([^"]+)",op="lookup"\} (\S+)', line)
            if hit:
                out[float(hit.group(1))] = float(hit.group(2))
        return out

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, arena: str | None = None, timeout: float = 30.0) -> float | None:
        """SIGTERM, and SIGKILL if it has not exited within ``timeout`` (then its ``arena`` is
        removed here, as a restarted daemon would). Seconds it took to exit after SIGTERM."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            if arena and _ARENA.fullmatch(arena):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", arena))
        return time.monotonic() - t0


_LEVEL = re.compile(r" (WARNING|ERROR|CRITICAL) (.*)")
_HEX = re.compile(r"\b[0-9a-f]{16,}\b")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def _warnings(log: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in log.splitlines():
        m = _LEVEL.search(line)
        if m:
            msg = f"{m.group(1)} {_NUMBER.sub('N', _HEX.sub('KEY', m.group(2)))[:200]}"
            counts[msg] = counts.get(msg, 0) + 1
        elif line.startswith("Traceback"):
            counts["Traceback"] = counts.get("Traceback", 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
