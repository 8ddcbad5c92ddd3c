"""Real-server fixtures for the remote tiers' tests (see :mod:`tests.remote_servers`)."""

from tests.remote_servers import (  # noqa: F401 (fixtures, found by pytest here)
    mooncake_private,
    mooncake_shared,
    valkey_cluster,
    valkey_private,
    valkey_standalone,
)
