"""The demo on the tiny model: users chat, every turn is answered by kvtier exactly as by a full
recompute, later turns hit (from DRAM or, once DRAM is outgrown, SSD), and the command line
prints the turns as JSON."""

import contextlib
import json
import time
from dataclasses import fields

import pytest
from click.testing import CliRunner

from kvtier import KVStore
from kvtier.cli import main
from kvtier.demo import DemoConfig, TurnRecord, plot, run_demo, summarize
from kvtier.engines.hf import HFEngine

RECORD_FIELDS = {
    "user", "turn", "history_tokens", "hit_tokens", "tier", "tier_tokens", "ttft_kvtier_s",
    "ttft_recompute_s", "same_tokens", "max_logit_diff", "load_hidden",
}
CLI_KEYS = {"user", "turn", "history_tokens", "hit_tokens", "tier", "ttft_kvtier_s", "ttft_recompute_s"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@contextlib.contextmanager
def users_read_each_reply():
    """Every request waits until the replies before it are saved, as when a user reads a reply
    before asking again. run_demo sends turns back to back, so otherwise how much a turn hits
    depends on thread timing (see test_a_follow_up_is_timed_after_the_reply_before_it_is_saved)."""
    real = HFEngine.generate

    def generate(self, *args, **kwargs):
        self.wait_for_saves()
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFEngine, "generate", generate)
        yield


@pytest.fixture(scope="module")
def demo_run(tiny_model_dir, tmp_path_factory):
    """Two users, two rounds, 16-token chunks and a DRAM tier smaller than both chats."""
    workdir = tmp_path_factory.mktemp("demo")
    seen: list[tuple[TurnRecord, int]] = []
    config = DemoConfig(
        model=str(tiny_model_dir), users=2, rounds=2, doc_chars=200, user_chars=60,
        system_chars=120, max_new_tokens=4, chunk_tokens=16, host_fraction=0.6,
        directory=str(workdir),
    )
    with users_read_each_reply():
        records = run_demo(config, on_turn=lambda rec, total: seen.append((rec, total)))
    return config, records, seen, workdir


def test_every_turn_is_recorded_and_answered_as_a_recompute_would(demo_run):
    config, records, seen, workdir = demo_run
    assert {f.name for f in fields(TurnRecord)} == RECORD_FIELDS
    assert set(records[0].as_dict()) == RECORD_FIELDS
    assert [(r.user, r.turn) for r in records] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)
    ]
    assert [rec for rec, _ in seen] == records and {total for _, total in seen} == {8}
    for r in records:
        assert r.same_tokens, r
        assert r.max_logit_diff <= 1e-5
        assert 0 <= r.hit_tokens < r.history_tokens and r.hit_tokens % config.chunk_tokens == 0
        assert sum(r.tier_tokens.values()) == r.hit_tokens
        assert (r.tier == "-") == (r.hit_tokens == 0)
        assert r.ttft_kvtier_s > 0 and r.ttft_recompute_s > 0
        assert 0.0 <= r.load_hidden <= 1.0
    assert list(workdir.iterdir()) == []  # the SSD tier's directory is cleaned up


def test_later_turns_hit_a_returning_user_from_ssd_and_a_follow_up_from_dram(demo_run):
    _, records, _, _ = demo_run
    by = {(r.user, r.turn): r for r in records}
    assert by[(1, 0)].hit_tokens > 0  # the second user hits the shared system prompt
    for user in (0, 1):
        for turn in (1, 2, 3):
            now, before = by[(user, turn)], by[(user, turn - 1)]
            assert now.history_tokens > before.history_tokens
            assert now.hit_tokens > before.history_tokens // 2  # most of the history was cached
    for user in (0, 1):
        # Back after the other user has filled DRAM: part of the history comes from SSD; the
        # save then brings the conversation back into DRAM for the quick follow-up.
        assert by[(user, 2)].tier == "disk" and by[(user, 2)].tier_tokens["disk"] > 0
        assert by[(user, 3)].tier == "host"


def test_a_follow_up_is_timed_after_the_reply_before_it_is_saved(tiny_model_dir, tmp_path, monkeypatch):
    # A user reads the reply before sending the follow-up, so in a real chat the reply's KV is
    # saved by then. The demo sends the follow-up at once: when saving takes longer than a
    # recompute (a slow SSD, a big model) the follow-up finds nothing, and the demo times a
    # miss as kvtier's TTFT.
    real_save = KVStore.save

    def slow_save(self, *args, **kwargs):
        time.sleep(0.3)
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(KVStore, "save", slow_save)
    config = DemoConfig(model=str(tiny_model_dir), users=1, rounds=1, doc_chars=100, user_chars=30,
                        system_chars=60, max_new_tokens=4, chunk_tokens=16, directory=str(tmp_path))
    first, follow_up = run_demo(config)
    assert follow_up.hit_tokens >= first.history_tokens // 16 * 16 > 0


def test_summarize_groups_turns_by_tier(demo_run):
    _, records, _, _ = demo_run
    summary = summarize(records, min_history=0)
    assert set(summary) == {r.tier for r in records} == {"-", "host", "disk"}
    assert sum(row["turns"] for row in summary.values()) == len(records)
    disk = [r for r in records if r.tier == "disk"]
    assert summary["disk"]["turns"] == len(disk)
    assert summary["disk"]["ttft_kvtier_s"] == pytest.approx(sum(r.ttft_kvtier_s for r in disk) / len(disk))
    assert summary["disk"]["ratio"] == pytest.approx(
        sum(r.ttft_kvtier_s / r.ttft_recompute_s for r in disk) / len(disk))
    assert set(summary["disk"]) == {"turns", "ttft_kvtier_s", "ttft_recompute_s", "ratio", "load_hidden"}
    assert summarize(records) == {}  # no tiny-model history reaches the default 4096 tokens


def test_plot_writes_a_png(demo_run, tmp_path):
    _, records, _, _ = demo_run
    path = tmp_path / "ttft.png"
    plot(records, str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_the_config_refuses_bad_values():
    with pytest.raises(ValueError, match="users"):
        DemoConfig(users=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        DemoConfig(chunk_tokens=0)
    with pytest.raises(ValueError, match="host_fraction"):
        DemoConfig(host_fraction=0)


# -- command line ------------------------------------------------------------------------------
# The CLI uses 256-token chunks and a 600-character system prompt: with the tiny model's
# one-token-per-character tokenizer every history spans several chunks.
def demo_args(model, tmp_path, *extra):
    return ["demo", "--model", str(model), "--users", "2", "--rounds", "1", "--doc-chars", "100",
            "--user-chars", "40", "--max-new-tokens", "4", "--dir", str(tmp_path), *extra]


def test_demo_command_prints_the_turns_as_json(tiny_model_dir, tmp_path):
    png = tmp_path / "plot.png"
    with users_read_each_reply():
        result = CliRunner().invoke(main, demo_args(tiny_model_dir, tmp_path, "--json", "--plot", str(png)))
    assert result.exit_code == 0, result.output
    turns = json.loads(result.stdout)
    assert isinstance(turns, list) and len(turns) == 4
    for item in turns:
        assert CLI_KEYS <= set(item)
        assert item["same_tokens"] is True
        assert item["history_tokens"] > 256
    assert all(t["hit_tokens"] >= 256 for t in turns if (t["user"], t["turn"]) != (0, 0))
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_demo_command_prints_a_table(tiny_model_dir, tmp_path):
    result = CliRunner().invoke(main, demo_args(tiny_model_dir, tmp_path))
    assert result.exit_code == 0, result.output
    assert "time to first token per turn" in result.stdout
    assert "OUTPUT DIFFERS" not in result.output


@pytest.mark.parametrize("model", ["huge", "no-such-dir", "empty-dir"])
def test_demo_command_refuses_a_bad_model(tmp_path, model):
    if model != "huge":
        model = tmp_path / model
        if model.name == "empty-dir":
            model.mkdir()
    result = CliRunner().invoke(main, demo_args(model, tmp_path, "--json"))
    assert result.exit_code != 0
    assert "Error" in result.output and "--model must be one of" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_the_demo_through_vllm_prints_the_same_json_keys(tiny_model_dir):
    pytest.importorskip("vllm")
    import os

    saved = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    try:
        res = CliRunner().invoke(main, ["demo", "--engine", "vllm", "--model", str(tiny_model_dir),
                                        "--users", "2", "--rounds", "1", "--doc-chars", "600",
                                        "--user-chars", "120", "--json"])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert res.exit_code == 0, res.output[-2000:]
    # vLLM may log to stdout in this process (its logging was set up by earlier tests)
    turns = json.loads(res.output[res.output.index("[\n  {"):])
    assert len(turns) == 4
    for t in turns:
        assert {"user", "turn", "history_tokens", "hit_tokens", "tier", "ttft_kvtier_s",
                "ttft_recompute_s"} <= set(t)
        assert t["same_tokens"]
    assert turns[1]["hit_tokens"] >= 256 and turns[1]["tier"] in ("host", "disk")
