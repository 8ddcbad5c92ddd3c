"""The truncation benchmark on the tiny model: each conversation's first overflowing turn is
served with moved KV and by a recompute, and the result says how far apart they are."""

import pytest

from kvtier.bench.truncation import TruncationBenchConfig, TruncationBenchResult, format_table, run

TINY = {"context_window": 600, "system_tokens": 80, "user_tokens": 120, "reply_tokens": 40,
        "new_tokens": 30, "steps": 12, "chunk_tokens": 16, "repeats": 2, "timings": 1}


def test_the_overflowing_turn_is_served_both_ways_and_compared(tiny_model_dir):
    config = TruncationBenchConfig(model=str(tiny_model_dir), **TINY)
    result = run(config)

    assert isinstance(result, TruncationBenchResult) and len(result.runs) == 2
    for r in result.runs:
        assert r.untruncated_tokens > config.context_window - config.steps  # it had to be cut
        assert r.prompt_tokens + config.steps <= config.context_window
        assert r.dropped_turns == 1 and r.dropped_tokens == r.untruncated_tokens - r.prompt_tokens
        assert r.prompt_tokens > r.hit_tokens > r.shifted_tokens > config.chunk_tokens
        assert r.prompt_tokens - r.hit_tokens < config.new_tokens + 2 * config.chunk_tokens
        assert r.ttft_reuse_s > 0 and r.ttft_recompute_s > 0
        assert 0 <= r.free_match <= 1 and 0.5 <= r.token_match <= 1
        assert 0 <= r.mean_kl < 0.05 and r.first_kl >= 0  # the tiny model's distributions are flat
    assert result.ratio == pytest.approx(result.ttft_reuse_s / result.ttft_recompute_s)
    summary = result.as_dict()
    assert summary["config"]["context_window"] == 600 and len(summary["runs"]) == 2

    table = format_table(result)
    assert "context window 600" in table and "0.15x target" in table
    assert len(table.splitlines()) == 2 + len(result.runs) + 1


@pytest.mark.parametrize("bad, match", [
    ({"context_window": 0}, "context_window must be positive"),
    ({"timings": 0}, "timings must be positive"),
    ({"context_window": 2048, "user_tokens": 768}, "cannot hold the system prompt and two turns"),
])
def test_the_config_is_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        TruncationBenchConfig(**bad)


def test_questions_scale_with_the_window_unless_given():
    assert TruncationBenchConfig().user_tokens == 768  # of 4096
    assert TruncationBenchConfig(context_window=2048).user_tokens == 384
    assert TruncationBenchConfig(user_tokens=100).user_tokens == 100


def test_the_cli_runs_it(tiny_model_dir):
    import json

    from click.testing import CliRunner

    from kvtier.cli import main

    args = ["bench", "truncation", "--model", str(tiny_model_dir), "--context-window", "600",
            "--system-tokens", "80", "--user-tokens", "120", "--reply-tokens", "40",
            "--new-tokens", "30", "--steps", "12", "--chunk-tokens", "16", "--repeats", "1",
            "--timings", "1"]
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config"]["context_window"] == 600
    res = CliRunner().invoke(main, ["bench", "truncation", "--context-window", "100"])
    assert res.exit_code != 0 and "cannot hold" in res.output
