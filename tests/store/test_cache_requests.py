"""Session hints in the live store, with real tiers: a retained session pushed down to SSD is
back in DRAM before it is due with no request touching it; a done session's chunks go first;
the quota refuses and counts; a request aborted while queued ends its part in its session; what
the DRAM policy stages never evicts a retained session's chunk; without hints nothing runs that
did not before."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.core.keys import ChunkKey
from kvtier.core.mover import Shape
from kvtier.core.session_hints import SessionHint
from kvtier.store.cache import CacheConfig, ChunkCache, Slot
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.disk_format import header_len_for
from kvtier.tiers.host_config import HostTierConfig


def cache_of(layout, tmp_path, host_chunks: int, disk: bool = True, **kw) -> ChunkCache:
    ssd = DiskTierConfig(str(tmp_path), 64 * (header_len_for(layout.num_layers) + layout.chunk_bytes))
    return ChunkCache(CacheConfig(host=HostTierConfig(host_chunks * layout.chunk_bytes,
                                                      extent_bytes=layout.chunk_bytes),
                                  disk=ssd if disk else None, **kw))


def keys(name: str, n: int) -> list[ChunkKey]:
    return [ChunkKey(f"{name}-{i}".encode().ljust(16, b".")) for i in range(n)]


def save(cache: ChunkCache, shape: Shape, chunks: list[ChunkKey], use: int | None = None) -> None:
    """As the daemon saves: reserve, fill, commit, then touch with the request's use."""
    for i, key in enumerate(chunks):
        res = cache.reserve(key, shape, position=i, remaining=len(chunks) - i)
        if isinstance(res, Slot):
            continue
        res.buffer.fill_(i)
        assert cache.commit(res, position=i)
    cache.touch(chunks, use=use)


def serve(cache: ChunkCache, shape: Shape, request: str, chunks: list[ChunkKey],
          hint: SessionHint | None, finish: bool = True, tenant: str | None = None) -> None:
    """A request as a vLLM connector drives it: queued (with its hint), started, saved, finished."""
    cache.queued(request, chunks, entry=shape, wait=False, prefetch=False, hint=hint, tenant=tenant)
    cache.started(request)
    save(cache, shape, chunks, use=cache.use_of(request))
    if finish:
        cache.finished(request)


def in_dram(cache: ChunkCache, chunks: list[ChunkKey]) -> list[bool]:
    return [cache.index.holds(key, 0) for key in chunks]


def test_a_retained_session_pushed_to_ssd_is_back_in_dram_before_its_return_with_no_request(layout, tmp_path):
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    agent, bulk = keys("agent", 2), keys("bulk", 4)
    with cache_of(layout, tmp_path, host_chunks=4, hint_share=0.9) as cache:
        before = time.monotonic()
        serve(cache, shape, "a-1", agent, SessionHint("agent", retain_s=60, return_s=2.0))
        finished = time.monotonic()  # its tool answers in 2 s: staged from 1 s after its finish on
        # a long request of a session back much later fills DRAM: the agent goes down to SSD
        serve(cache, shape, "b-1", bulk, SessionHint("bulk", retain_s=600, return_s=300))
        assert in_dram(cache, agent) == [False, False] and cache.index.holds(agent[0], 1)
        while not all(in_dram(cache, agent)):  # no request comes: the tick stages it
            assert time.monotonic() < finished + 2.0, "the session was not back in DRAM before its return"
            time.sleep(0.02)
        assert time.monotonic() >= before + 1.0  # not before its lead
        snap = cache.snapshot()
        assert snap["hint_stagings"] == 1 and snap["hint_staged_chunks"] == 2
        assert snap["hints_accepted"] == 2 and snap["sessions_retained"] == 2
        ticks = cache._ticks
        assert ticks is not None and ticks.is_alive()
    assert not ticks.is_alive()  # close stops it


def test_a_done_session_goes_before_a_live_one_and_before_unhinted_chunks_but_its_shared_chunk_stays(
        layout, tmp_path):
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    system, live, done, plain = keys("system", 1), keys("live", 1), keys("done", 1), keys("plain", 1)
    with cache_of(layout, tmp_path, host_chunks=4, disk=False, hint_share=1.0) as cache:
        serve(cache, shape, "live-1", system + live, SessionHint("live", retain_s=60), finish=False)
        serve(cache, shape, "done-1", system + done, SessionHint("gone", done=True))
        save(cache, shape, plain)
        assert cache.snapshot()["sessions_done"] == 1
        save(cache, shape, keys("new", 1))  # DRAM is full: the done session's own chunk goes
        assert in_dram(cache, system + live + done + plain) == [True, True, False, True]
        save(cache, shape, keys("newer", 1))  # then the unhinted one, before the live session's
        assert in_dram(cache, system + live + plain) == [True, True, False]


def test_the_quota_refuses_a_hint_serves_its_request_and_counts_it(layout, tmp_path):
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    with cache_of(layout, tmp_path, host_chunks=4, disk=False, hint_share=0.25) as cache:  # a chunk a tenant
        serve(cache, shape, "r-1", keys("long", 2), SessionHint("long", retain_s=60, tenant="acme"))
        serve(cache, shape, "r-2", keys("short", 1), SessionHint("short", retain_s=60, tenant="acme"))
        serve(cache, shape, "r-3", keys("theirs", 1), SessionHint("theirs", retain_s=60))
        snap = cache.snapshot()
        assert (snap["hints_accepted"], snap["hints_refused"], snap["sessions_retained"]) == (2, 1, 2)
        assert all(in_dram(cache, keys("long", 2)))  # served and saved all the same


def test_a_salt_is_scoped_by_the_requests_tenant_never_another_tenants_session_or_quota(layout, tmp_path):
    """``cache_salt`` is a client's field: two engines' tenants whose users send the same salt
    and session name hold two sessions, each under its own tenant's quota."""
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    with cache_of(layout, tmp_path, host_chunks=4, disk=False, hint_share=0.25) as cache:  # a chunk a tenant
        serve(cache, shape, "a-1", keys("a", 1), SessionHint("s", retain_s=60, tenant="user1"), tenant="a")
        serve(cache, shape, "b-1", keys("b", 1), SessionHint("s", retain_s=60, tenant="user1"), tenant="b")
        snap = cache.snapshot()
        assert (snap["hints_accepted"], snap["hints_refused"], snap["sessions_retained"]) == (2, 0, 2)
        serve(cache, shape, "a-2", keys("a2", 1), SessionHint("t", retain_s=60, tenant="user1"), tenant="a")
        assert cache.snapshot()["hints_refused"] == 1  # tenant a's salt user1 holds its share


def test_a_hinted_request_aborted_while_queued_lets_its_session_expire(layout, tmp_path):
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    chunks, hint = keys("s", 2), SessionHint("s", retain_s=0.2)
    with cache_of(layout, tmp_path, host_chunks=8, hint_share=0.9) as cache:
        serve(cache, shape, "r-1", chunks, hint)
        cache.queued("r-2", chunks, entry=shape, wait=False, prefetch=False, hint=hint)
        cache.finished("r-2")  # aborted before it started
        time.sleep(0.3)  # past retain_s
        with cache._section:
            cache.sessions.advance(time.monotonic())
        assert cache.snapshot()["sessions_retained"] == 0


def test_what_the_dram_policy_stages_never_evicts_a_retained_sessions_chunk(layout, tmp_path):
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    plain, agent = keys("plain", 1), keys("agent", 2)
    with cache_of(layout, tmp_path, host_chunks=2, hint_share=0.9) as cache:
        save(cache, shape, plain)
        serve(cache, shape, "a-1", agent, SessionHint("agent", retain_s=60, return_s=30))
        assert in_dram(cache, agent + plain) == [True, True, False]  # plain went down to SSD
        cache.placement.staging = lambda now: [plain]  # the policy guesses plain comes back
        cache.started("r-2")
        assert cache.flush(10)
        assert in_dram(cache, agent + plain) == [True, True, False]  # no room it may take


def test_without_hints_no_session_thread_runs_and_nothing_is_counted(layout, tmp_path):
    shape = Shape(layout.chunk_bytes, layout.layer_bytes)
    before = threading.active_count()
    with cache_of(layout, tmp_path, host_chunks=2) as cache:
        for i in range(4):
            serve(cache, shape, f"r-{i}", keys(f"s{i}", 2), None)
        assert cache._ticks is None and not cache.sessions.tracking
        snap = cache.snapshot()
        assert snap["hints_accepted"] == snap["hint_stagings"] == snap["sessions_retained"] == 0
    assert threading.active_count() <= before


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_hint_share_is_checked(layout, share):
    with pytest.raises(ValueError, match="hint_share"):
        CacheConfig(host=HostTierConfig(4 * layout.chunk_bytes), hint_share=share)
