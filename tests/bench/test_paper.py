"""The AttentionStore-paper replay's building blocks: re-timing a sessions trace, the paper's
models and capacities, and the rows (on a small generated trace, not the paper's workload)."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.bench import paper
from kvtier.bench.trace import parse_trace
from kvtier.bench.workload import WorkloadConfig, generate


def sessions_trace():
    return parse_trace(sessions_lines())


def sessions_lines() -> list[str]:
    import io
    import json

    out = io.StringIO()
    generate(WorkloadConfig(requests=300, session_rate=2.0, think_mean_s=30.0, system_tokens=512, seed=3), out)
    # name each request's session: a prompt extends the previous one of its session
    lines, last = [], {}
    for raw in out.getvalue().splitlines():
        obj = json.loads(raw)
        ids = obj["hash_ids"]
        sid = next((s for s, tail in last.items() if tail in ids), None)
        sid = len(last) if sid is None else sid
        last[sid] = ids[-2] if len(ids) > 1 else ids[-1]
        obj["session_id"] = sid
        lines.append(json.dumps(obj))
    return lines


def test_per_session_think_times_give_each_session_a_pace_of_its_own():
    import json

    import numpy as np

    # 60 sessions of 9 turns: enough to tell a session's pace from its spread around it
    lines = [json.dumps({"timestamp": 1000 * s + turn, "input_length": 512 * (turn + 1), "output_length": 8,
                         "hash_ids": list(range(100 * s, 100 * s + turn + 1)), "session_id": s})
             for s in range(60) for turn in range(9)]
    timed = paper.retime(parse_trace(sorted(lines, key=lambda x: json.loads(x)["timestamp"])), 60.0, seed=2,
                         think="per-session")
    thinks: dict[object, list[float]] = {}
    for r in timed.requests:
        if r.think_s is not None:
            thinks.setdefault(r.session_id, []).append(r.think_s)
    long = [np.array(t) for t in thinks.values()]
    assert len(long) == 60 and all(len(t) == 8 for t in long)
    within = np.mean([np.var(t, ddof=1) / np.mean(t) ** 2 for t in long]) ** 0.5
    assert within == pytest.approx(0.5, abs=0.15)  # gamma of shape 4 around the session's pace
    assert np.std(np.log([t.mean() for t in long])) > 0.3  # users differ
    assert np.mean(np.concatenate(long)) == pytest.approx(60.0, rel=0.25)
    assert paper.Setup().think == paper.THINK_KIND == "per-session"  # the replay's default


def test_the_papers_models_have_the_kv_sizes_it_states():
    sizes = {name: round(m.kv_mb_per_token, 2) for name, m in paper.MODELS.items()}
    assert sizes == {"llama-2-13b": 0.78, "llama-65b": 2.5, "llama-2-70b": 0.31, "falcon-40b": 0.12}


def test_retiming_keeps_each_sessions_order_and_first_arrival():
    trace = sessions_trace()
    timed = paper.retime(trace, 600.0, seed=1)
    assert len(timed.requests) == len(trace.requests)
    first = {}
    for r in trace.requests:
        first.setdefault(r.session_id, r.arrival_s)
    seen: dict[object, float] = {}
    for r in timed.requests:
        if r.session_id not in seen:
            assert r.arrival_s == first[r.session_id]
        else:
            assert r.arrival_s >= seen[r.session_id]
        seen[r.session_id] = r.arrival_s
    fixed = paper.retime(trace, 45.0, think="fixed")
    gaps: dict[object, list[float]] = {}
    prev: dict[object, float] = {}
    for r in fixed.requests:
        if r.session_id in prev:
            gaps.setdefault(r.session_id, []).append(r.arrival_s - prev[r.session_id])
        prev[r.session_id] = r.arrival_s
    assert gaps and all(g == pytest.approx(45.0) for gs in gaps.values() for g in gs)
    with pytest.raises(ValueError, match="think must be one of"):
        paper.retime(trace, 45.0, think="pareto")
    with pytest.raises(ValueError, match="names sessions"):
        paper.retime(parse_trace(['{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}']), 60)


def test_rows_carry_the_papers_figures_beside_kvtiers_at_its_capacities_only():
    rows = paper.rows(sessions_trace(), 0.01, models=("llama-2-13b",), policies=("lru", "attentionstore"))
    assert len(rows) == 8  # two capacities, two tier setups, two policies
    by = {(r.policy, r.dram_only, r.capacity): r for r in rows}
    assert by[("attentionstore", False, 1.0)].paper_hit_rate == 0.86
    assert by[("lru", False, 1.0)].paper_hit_rate == 0.58
    assert by[("lru", False, 1.0)].paper_dram_share == 0.01
    assert by[("attentionstore", True, 1.0)].paper_hit_rate == 0.034
    assert by[("attentionstore", False, 0.25)].paper_hit_rate is None
    assert all(0.0 <= r.hit_rate <= 1.0 for r in rows)
    full, quarter = by[("lru", False, 1.0)], by[("lru", False, 0.25)]
    block = paper.MODELS["llama-2-13b"].layout.chunk_bytes
    assert full.dram_bytes == int(paper.DRAM_BYTES * 0.01 // block) * block
    assert full.ssd_bytes == int(paper.SSD_BYTES * 0.01 // block) * block
    assert quarter.ssd_bytes == int(paper.SSD_BYTES * 0.0025 // block) * block
    assert by[("lru", True, 1.0)].ssd_bytes == 0
    for r in rows:  # the replay's bounds ride along: staging helps fewer requests than DRAM could
        assert r.prefill_saved <= r.prefill_saved_if_staged <= r.prefill_saved_if_in_dram + 1e-12
    assert any(r.prefill_saved_if_staged < r.prefill_saved_if_in_dram for r in rows if not r.dram_only)
    setup = paper.Setup()  # the very figures of the policy's own replay
    own = paper.replay(setup.timed(sessions_trace()),
                       paper.config_for(paper.MODELS["llama-2-13b"], "attentionstore", False, 0.01, setup))
    headline = by[("attentionstore", False, 1.0)]
    assert (headline.prefill_saved_if_staged, headline.prefill_saved_if_in_dram) == (
        own.prefill_saved_if_staged, own.prefill_saved_if_in_dram)


def test_unlimited_finds_every_saved_block_and_bounds_the_policies():
    rows = paper.rows(sessions_trace(), 0.002, models=("llama-65b",), policies=("fifo", "lru", "unlimited"),
                      capacities=(1.0,))
    by = {(r.policy, r.dram_only): r for r in rows}
    assert by[("unlimited", False)].hit_rate == pytest.approx(1.0)
    assert by[("unlimited", False)].dram_bytes is None  # no capacity: none stated
    assert by[("unlimited", True)].hit_rate == by[("unlimited", False)].hit_rate
    assert by[("lru", True)].hit_rate < by[("lru", False)].hit_rate < 1.0  # the capacities bind
    for r in rows:
        assert r.hit_rate <= by[("unlimited", r.dram_only)].hit_rate + 1e-12
        assert r.prefill_saved <= by[("unlimited", r.dram_only)].prefill_saved + 1e-12


def test_calibration_finds_the_scale_that_hits_the_published_rate():
    trace = sessions_trace()
    seen = []
    memoryless = paper.Setup(think="exponential")  # on this small trace the hit rate moves smoothly
    cal = paper.calibrate(trace, memoryless, rounds=14, progress=lambda s, h: seen.append((s, h)))
    assert len(seen) == 15 and 1e-3 < cal.scale < 1.0 and seen[-1] == (cal.scale, cal.hit_rate)
    name, policy, dram_only, target = paper.CALIBRATE_ON
    got = paper.replay(paper.retime(trace, paper.THINK_S, think="exponential"),
                       paper.config_for(paper.MODELS[name], policy, dram_only, cal.scale)).hit_rate
    assert got == cal.hit_rate == pytest.approx(target, abs=0.01) and cal.reached
    far = paper.calibrate(trace, memoryless, rounds=4, lo=1e-3, hi=2e-3)  # too little capacity for 86%
    assert not far.reached and far.hit_rate < target - 0.1
    with pytest.raises(ValueError, match="lo < hi"):
        paper.calibrate(trace, lo=1.0, hi=0.5)


def test_gains_compare_prefill_saved_per_setup():
    rows = paper.rows(sessions_trace(), 0.01, models=("llama-2-13b",), policies=("attentionstore", "returns"),
                      capacities=(1.0,))
    found = {(m, d, c): g for m, d, c, g in paper.gains(rows, "returns")}
    assert set(found) == {("llama-2-13b", False, 1.0), ("llama-2-13b", True, 1.0)}
    by = {(r.policy, r.dram_only): r for r in rows}
    base = by[("attentionstore", False)].prefill_saved
    assert base > 0
    assert found[("llama-2-13b", False, 1.0)] == pytest.approx(by[("returns", False)].prefill_saved / base)
    for base_saved in (-0.5, 0.0):  # no ratio means anything against a baseline that saved nothing
        lost = [dataclasses.replace(by[("attentionstore", True)], prefill_saved=base_saved), by[("returns", True)]]
        assert paper.gains(lost, "returns") == [("llama-2-13b", True, 1.0, None)]


def test_config_for_refuses_a_bad_scale():
    with pytest.raises(ValueError, match="capacity scale"):
        paper.config_for(paper.MODELS["llama-2-13b"], "lru", scale=0.0)


def write_sessions(tmp_path) -> str:
    path = tmp_path / "sessions.jsonl"
    path.write_text("\n".join(sessions_lines()) + "\n")
    return str(path)


def test_the_cli_prints_the_papers_figures_beside_kvtiers(tmp_path):
    import json

    from click.testing import CliRunner

    from kvtier.cli import main

    path = write_sessions(tmp_path)
    res = CliRunner().invoke(main, ["replay", path, "--paper", "attentionstore", "--models", "llama-2-13b",
                                    "--capacity-scale", "0.01", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    policies = [*paper.POLICIES, *paper.BOUNDS]
    assert len(out) == 2 * 2 * len(policies)  # capacities x tier setups x policies
    assert {o["policy"] for o in out} == set(policies)
    for o in out:
        assert {"model", "policy", "dram_only", "hit_rate", "dram_share_of_hits", "prefill_saved",
                "paper_hit_rate", "capacity_scale"} <= set(o)
        assert o["capacity_scale"] == pytest.approx(0.01 * o["capacity"])
        assert o["calibrated"] is False and o["calibration_hit_rate"] is None  # a given scale
    headline = next(o for o in out if o["policy"] == "attentionstore" and not o["dram_only"] and o["capacity"] == 1)
    assert headline["paper_hit_rate"] == 0.86 and headline["model"] == "llama-2-13b"

    res = CliRunner(env={"COLUMNS": "250"}).invoke(main, ["replay", path, "--paper", "attentionstore", "--models", "falcon-40b",
                                    "--policy", "lru,attentionstore", "--ssd-gbps", "10",
                                    "--think", "exponential"])
    assert res.exit_code == 0, res.output
    assert "calibrating the capacity scale on llama-2-13b" in res.stderr
    assert "AttentionStore (ATC '24) beside kvtier" in res.stdout and "falcon-40b" in res.stdout
    assert "SSD 10 GB/s" in res.stdout and "of 2 published hit rates\n" in res.stdout
    assert "(fitted)" not in res.stdout  # the fitted figure is the 13B model's, not run here
    assert "calibrated: capacity scale" in res.stderr and "--capacity-scale" in res.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--paper", "attentionstore", "--dram-blocks", "10"], "drop --dram-blocks"),
    (["--paper", "attentionstore", "--sweep"], "drop --sweep"),
    (["--paper", "attentionstore", "--plot", "x.png"], "drop --plot"),
    (["--paper", "attentionstore", "--models", "gpt-5"], "unknown model 'gpt-5'"),
    (["--paper", "attentionstore", "--policy", "mru"], "unknown policy 'mru'"),
    (["--think-s", "30"], "--think-s applies only with --paper"),
    (["--think", "fixed"], "--think applies only with --paper"),
    (["--loop", "open"], "--loop applies only with --paper"),
    (["--decode-ms-per-token", "1"], "--decode-ms-per-token applies only with --paper"),
    (["--capacity-scale", "0.1"], "--capacity-scale applies only with --paper"),
])
def test_the_cli_refuses_what_the_paper_replay_cannot_take(tmp_path, args, message):
    from click.testing import CliRunner

    from kvtier.cli import main

    res = CliRunner().invoke(main, ["replay", write_sessions(tmp_path), *args])
    assert res.exit_code == 2 and message in res.output, res.output


def test_the_cli_refuses_a_trace_without_sessions(tmp_path):
    from click.testing import CliRunner

    from kvtier.cli import main

    path = tmp_path / "plain.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}\n')
    res = CliRunner().invoke(main, ["replay", str(path), "--paper", "attentionstore"])
    assert res.exit_code == 2 and "names no sessions" in res.output


def test_a_queue_hurts_lru_only_in_a_closed_loop_and_attentionstore_keeps_the_queued_sessions():
    trace, model = sessions_trace(), paper.MODELS["llama-2-13b"]

    def hit(policy: str, closed: bool, decode: float) -> float:
        setup = paper.Setup(think="exponential", closed_loop=closed, decode_s_per_token=decode)
        return paper.replay(setup.timed(trace), paper.config_for(model, policy, False, 0.005, setup)).hit_rate

    # Open loop: the order of requests is the trace's, whatever the queue, and LRU sees only order.
    assert hit("lru", False, 0.002) == hit("lru", False, 0.0)
    # Closed loop: a loaded server delays each conversation's return, so more of the others pass
    # through the cache in between.
    assert hit("lru", True, 0.002) < hit("lru", True, 0.0) - 0.02
    # AttentionStore's window protects whatever is queued: the deeper the queue, the more it keeps.
    for closed in (False, True):
        assert hit("attentionstore", closed, 0.002) > hit("lru", closed, 0.002) + 0.05
        assert hit("attentionstore", closed, 0.0) >= hit("lru", closed, 0.0)


def test_in_a_closed_loop_optimal_replays_the_order_attentionstore_served():
    rows = paper.rows(sessions_trace(), 0.005, models=("llama-2-13b",),
                      policies=("attentionstore", "optimal", "unlimited"), capacities=(1.0,))
    by = {(r.policy, r.dram_only): r for r in rows}
    for dram_only in (False, True):
        assert by[("optimal", dram_only)].hit_rate >= by[("attentionstore", dram_only)].hit_rate
        assert by[("optimal", dram_only)].hit_rate <= by[("unlimited", dram_only)].hit_rate + 1e-12
    for r in rows:  # the bounds are a live policy's own replay's; the offline ones replay another order
        bounds = (r.prefill_saved_if_staged, r.prefill_saved_if_in_dram)
        assert (bounds == (None, None)) == (r.policy != "attentionstore"), r
    alone = paper.rows(sessions_trace(), 0.005, models=("llama-2-13b",), policies=("optimal",), capacities=(1.0,))
    assert [r.hit_rate for r in alone] == [by[("optimal", False)].hit_rate, by[("optimal", True)].hit_rate]
