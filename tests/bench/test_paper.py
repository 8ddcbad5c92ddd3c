"""The AttentionStore-paper replay's building blocks: re-timing a sessions trace, the paper's
models and capacities, and the rows (on a small generated trace, not the paper's workload)."""

from __future__ import annotations

import pytest

from kvtier.bench import paper
from kvtier.bench.trace import parse_trace
from kvtier.bench.workload import WorkloadConfig, generate


def sessions_trace():
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
    return parse_trace(lines)


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
    with pytest.raises(ValueError, match="names sessions"):
        paper.retime(parse_trace(['{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}']), 60)


def test_rows_carry_the_papers_figures_beside_kvtiers():
    rows = paper.rows(sessions_trace(), 60.0, models=("llama-2-13b",), policies=("lru", "attentionstore"))
    assert len(rows) == 4
    by = {(r.policy, r.dram_only): r for r in rows}
    assert by[("attentionstore", False)].paper_hit_rate == 0.86
    assert by[("lru", False)].paper_hit_rate == 0.58
    assert by[("attentionstore", True)].paper_hit_rate == 0.034
    assert all(0.0 <= r.hit_rate <= 1.0 for r in rows)
