"""The daemon's operations as a client meets them: a session hint on ``queued`` is checked field
by field, counted, and shown in the stats and the metrics; a ``done`` hint dooms only what its
own request used."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvtier.core.session_hints import SessionHint
from kvtier.errors import DaemonUnavailable
from kvtier.server.client import StoreClient
from kvtier.server.daemon import DaemonConfig, StoreDaemon
from kvtier.server.metrics import Metrics
from kvtier.store.cache import CacheConfig
from kvtier.tiers.host_config import HostTierConfig

from ..conftest import make_kv
from .test_daemon import LAYOUT, MODEL

C = LAYOUT.chunk_tokens


@pytest.fixture
def daemon(tmp_path):
    d = StoreDaemon(DaemonConfig(str(tmp_path / "kv.sock"), CacheConfig(
        HostTierConfig(8 * LAYOUT.chunk_bytes, extent_bytes=LAYOUT.chunk_bytes), hint_share=0.5))).start()
    yield d
    d.stop()


@pytest.mark.parametrize(("hint", "field"), [
    ({"retain_s": 5}, "hint.session"),
    ({"session": "a b"}, "hint.session"),
    ({"session": "a", "retain_s": -1}, "hint.retain_s"),
    ({"session": "a", "retain_s": 5, "return_s": 9}, "hint.return_s"),
    ({"session": "a", "done": "yes"}, "hint.done"),
    ({"session": "a", "color": "red"}, "hint.color"),
    ("agent-1", "hint must be an object"),
])
def test_a_malformed_hint_on_queued_is_refused_naming_the_field(daemon, hint, field):
    client = StoreClient(daemon.config.socket_path, model=MODEL, layout=LAYOUT)
    try:
        keys = client.keys_for(list(range(2 * C)))
        conn = client._link.connect()
        with pytest.raises(DaemonUnavailable, match=f"queued: {field}"):
            client._link.exchange(conn, {"op": "queued", "request_id": "r-1", "keys": keys, "hint": hint})
        assert client.stats()["hints_accepted"] == 0
    finally:
        client.close()


def test_a_hint_on_queued_is_counted_in_the_stats_and_the_metrics(daemon):
    client = StoreClient(daemon.config.socket_path, model=MODEL, layout=LAYOUT, instance="engine-A")
    try:
        keys = client.keys_for(list(range(2 * C)))
        client.queued("r-1", keys, prefetch=False, hint=SessionHint("agent-1", retain_s=60, return_s=4))
        client.queued("r-2", keys, prefetch=False, hint=SessionHint("agent-2", done=True))
        client.started("r-2")
        client.finished("r-2")
        client.finished("never-queued")  # an unknown request: harmless
        assert client.errors == 0
        snap = client.stats()
        assert (snap["hints_accepted"], snap["hints_refused"], snap["sessions_retained"],
                snap["sessions_done"]) == (2, 0, 1, 1)
        body = generate_latest(Metrics(daemon.snapshot).registry).decode()
        assert "kvtier_hints_accepted_total 2.0" in body and "kvtier_sessions_retained 1.0" in body
        assert "kvtier_sessions_done_total 1.0" in body and "kvtier_hint_staged_chunks_total 0.0" in body
    finally:
        client.close()


def test_a_done_hint_from_whoever_knows_a_session_dooms_only_its_own_requests_chunks(daemon):
    client = StoreClient(daemon.config.socket_path, model=MODEL, layout=LAYOUT)
    try:
        tokens = list(range(3 * C))
        keys = client.keys_for(tokens)
        client.queued("r-1", keys, prefetch=False, hint=SessionHint("agent-1", retain_s=60))
        client.started("r-1")
        assert client.save(tokens, make_kv(LAYOUT, 3 * C), request="r-1").stored == 3
        client.finished("r-1")
        # another client that knows the session's id and its public first chunk ends it
        client.queued("x-1", keys[:1], prefetch=False, hint=SessionHint("agent-1", done=True))
        client.started("x-1")
        client.finished("x-1")
        assert client.errors == 0 and client.stats()["sessions_done"] == 1
        (doomed,) = daemon.cache.sessions.doomed.keys()  # not the session's other two chunks
        assert daemon.cache.index.position(doomed) == 0
    finally:
        client.close()
