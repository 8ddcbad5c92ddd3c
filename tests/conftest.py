import logging

import pytest
import torch

from kvtier.core.layout import KVLayout
from tests.remote_servers import (  # noqa: F401 - real-server fixtures, found by pytest here
    mooncake_private,
    mooncake_shared,
    valkey_cluster,
    valkey_private,
    valkey_standalone,
)


@pytest.fixture
def layout() -> KVLayout:
    # 4 layers x (K, V) x 2 heads x 16 tokens x 32 dims x 4 bytes = 4 KiB a layer, 16 KiB a chunk.
    return KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32", chunk_tokens=16)


def make_kv(layout: KVLayout, tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic per-layer (K, V), each [heads, tokens, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(layout.num_layers)
    ]


@pytest.fixture(autouse=True)
def _kvtier_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The embedded ``tiny`` default model, built once per session in a private KVTIER home
    (never the user's ~/.cache)."""
    from kvtier.engines.default_model import default_model_dir

    return default_model_dir("tiny", home=tmp_path_factory.mktemp("kvtier-home"))


# -- the modules that start vLLM go first ------------------------------------------------------
HEAVY_FIRST = ("test_vllm_connector.py", "test_real_model.py", "test_vllm_two_instances.py", "test_quickstart.py",
               "test_serve_bench.py", "test_leases.py", "test_daemon.py", "test_vllm_conversations.py",
               "test_vllm_serve.py", "test_launch.py", "test_hostile.py", "test_mooncake.py", "test_trust.py",
               "test_vllm_stall.py", "test_demo.py")
"""Modules whose engines or servers take most of the suite's time (tens of seconds to minutes
each), in the order of their measured cost (`pytest --durations=0`, 2026-12-07): run first, so
that `make test`'s two workers (pytest-xdist, a module each at a time) end together rather than
one waiting for the other's last minute-long module."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # (stable: the rest as collected)


# -- nothing of the suite is left in /dev/shm ---------------------------------------------------
SHM = "/dev/shm"
_shm_before: set[str] = set()
_shm_first_seen: dict[str, str] = {}


def _kvtier_shm() -> set[str]:
    import os

    try:
        return {n for n in os.listdir(SHM) if n.startswith("kvtier-")}
    except OSError:
        return set()


def _in_use(name: str) -> bool:
    """Whether a live process maps or holds open ``/dev/shm/<name>``."""
    import glob
    import os

    path = f"{SHM}/{name}"
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                if path in f.read():
                    return True
        except OSError:
            continue
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == path:
                return True
        except OSError:
            continue
    return False


def pytest_sessionstart(session: pytest.Session) -> None:
    _shm_before.update(_kvtier_shm())


@pytest.fixture(autouse=True)
def _shm_owner(request: pytest.FixtureRequest):
    """Which test an arena in /dev/shm first appeared in (for the session's final check)."""
    yield
    for name in _kvtier_shm() - _shm_before:
        _shm_first_seen.setdefault(name, request.node.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it left a shared-memory arena behind: a user's machine would keep it
    (and its RAM) until reboot. With pytest-xdist the controller looks, once every worker is
    done (a worker finishing first would see another's arenas come and go)."""
    import time

    if hasattr(session.config, "workerinput"):
        return

    deadline = time.monotonic() + 5  # daemons of the last module may still be stopping
    while (left := _kvtier_shm() - _shm_before) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {n for n in left if not _in_use(n)}  # a concurrent session's live arenas are its own
    if left:
        where = ", ".join(f"{n} (first seen after {_shm_first_seen.get(n, '?')})" for n in sorted(left))
        print(f"\nkvtier test suite left shared memory behind in {SHM}: {where}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
