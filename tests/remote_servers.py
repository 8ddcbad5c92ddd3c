"""Fixtures that start real loopback servers for the remote-tier tests (no mocks).

Servers come from :mod:`kvtier.bench.servers` and run under pytest's temporary directories; each
fixture stops its servers at teardown, also when a test fails (and a server dies with the test
process if that is killed). Shared servers are module-scoped; a test that kills or pauses a
server gets its own. ``tests/tiers/conftest.py`` imports the fixtures for the tier tests; another
test module imports the ones it uses::

    from tests.remote_servers import valkey_standalone  # noqa: F401 (a fixture)
"""

from __future__ import annotations

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
