"""The multi-turn session generator writes traces replay can read, with session structure."""

import io
import json

import pytest

from kvtier.bench.trace import parse_trace
from kvtier.bench.workload import WorkloadConfig, generate


def test_turns_of_a_session_reuse_the_whole_previous_prompt_but_its_partial_block():
    out = io.StringIO()
    assert generate(WorkloadConfig(requests=400, system_tokens=1024, seed=3), out) == 400
    rows = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    trace = parse_trace(out.getvalue().splitlines())  # valid Mooncake format
    assert len(trace.requests) == 400
    follow_ups = 0
    for i, r in enumerate(rows):
        full = r["input_length"] // 512
        for earlier in rows[:i]:
            prev_full = earlier["input_length"] // 512
            if prev_full > 2 and r["hash_ids"][:prev_full] == earlier["hash_ids"][:prev_full] \
                    and r["input_length"] > earlier["input_length"] and full > prev_full:
                follow_ups += 1
                break
    assert follow_ups > 100
    firsts = {tuple(r["hash_ids"][:2]) for r in rows if r["input_length"] >= 1024}
    assert len(firsts) <= 8  # every prompt opens with one of the shared system prompts


def test_the_same_seed_gives_the_same_trace():
    a, b = io.StringIO(), io.StringIO()
    generate(WorkloadConfig(requests=50, seed=7), a)
    generate(WorkloadConfig(requests=50, seed=7), b)
    assert a.getvalue() == b.getvalue()


@pytest.mark.parametrize("kw", [{"requests": 0}, {"turns_mean": 0.5}, {"think_mean_s": 0}])
def test_bad_configs_are_refused(kw):
    with pytest.raises(ValueError):
        WorkloadConfig(**kw)
