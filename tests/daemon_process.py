"""A real `kvtier store serve` process for tests: started on a config file, stopped, killed."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtier.server.client import StoreClient

KVTIER = str(Path(sys.executable).with_name("kvtier"))


def wait_for_socket(path: Path, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "daemon exited"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    raise TimeoutError(f"daemon did not listen on {path}")


class DaemonProcess:
    """The daemon's stderr goes to ``log`` (a pipe nobody reads could fill and stall it)."""

    def __init__(self, config: Path, socket_path: Path, log: Path) -> None:
        self.config = config
        self.socket = socket_path
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> DaemonProcess:
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen([KVTIER, "store", "serve", "--config", str(self.config)],
                                         stderr=err, text=True)
        wait_for_socket(self.socket, self.proc)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def stats(self) -> dict:
        return daemon_stats(self.socket)

    def pause(self) -> None:
        """SIGSTOP the daemon, and wait until it is stopped (delivery is not immediate)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        status = Path(f"/proc/{self.proc.pid}/status")
        deadline = time.monotonic() + 10
        while "T (stopped)" not in status.read_text():
            assert time.monotonic() < deadline, "the daemon did not stop"
            time.sleep(0.005)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def daemon_stats(socket_path: Path | str) -> dict:
    """The stats of the daemon at ``socket_path``, through a client of its own."""
    client = StoreClient(str(socket_path))
    try:
        return client.stats()
    finally:
        client.close()
