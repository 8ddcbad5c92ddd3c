"""The codec benchmark on the tiny model and a small ShareGPT file: the exact KV of a history
against each codec's, row by row; and the TTFT benchmark's SSD hits per codec."""

import json

import pytest
from click.testing import CliRunner

from kvtier.bench.codecs import (
    CodecBenchConfig,
    fit_histories,
    history_stream,
    run_codec_bench,
)
from kvtier.bench.codecs_report import target_checks
from kvtier.bench.ttft import TTFTBenchConfig, run_ttft_bench
from kvtier.cli import main

REPLY = ("A cache keeps what was computed so that it need not be computed again. For a language "
         "model the keys and values of every layer are kept for the tokens already seen, and a "
         "new turn of the conversation attends to them instead of reading the whole history "
         "once more. ")


@pytest.fixture
def sharegpt(tmp_path):
    """A ShareGPT JSON file of a few two-turn conversations, its array cut off at the end as the
    real file's is."""
    convs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what does a KV cache keep?"},
        {"from": "gpt", "value": REPLY * (1 + i % 2)},
        {"from": "human", "value": "And where does it keep it when memory runs out?"},
        {"from": "gpt", "value": "On the next tier: host memory, then a local SSD, then a remote store."},
    ]} for i in range(6)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs)[:-40])
    return path


def test_each_codec_is_scored_against_the_exact_kv(tiny_model_dir, sharegpt, tmp_path):
    config = CodecBenchConfig(model=str(tiny_model_dir), histories=(32, 64), score_tokens=8,
                              chunk_tokens=16, timing_runs=1, dataset=str(sharegpt), directory=str(tmp_path))
    result = run_codec_bench(config)

    rows = {(r.codec, r.history_tokens): r for r in result.rows}
    assert sorted(rows) == sorted((c, h) for c in ("none", "fp8", "int8", "int4") for h in (32, 64))
    for h in (32, 64):
        none, int8, int4 = rows["none", h], rows["int8", h], rows["int4", h]
        assert none.kl == 0 and none.top1 == 1 and none.ppl_ratio == 1  # raw bytes: the exact KV
        assert none.bytes_ratio == 2.0  # float32 KV against bfloat16
        assert int4.bytes_ratio < int8.bytes_ratio <= rows["fp8", h].bytes_ratio < 1
        assert 0 < int8.kl < int4.kl < 0.1
        for r in (int8, int4):
            assert r.tokens_scored == 8 and r.coded_tokens == h and r.raw_chunks == 0
            assert r.encode_GBps > 0 and r.decode_GBps > 0 and r.ssd_GBps > 0
            assert r.bytes_per_token == pytest.approx(r.bytes_ratio * none.bytes_per_token / 2)
    assert result.ssd_direct_io is not None and result.conversations >= 1
    whats = [c.what for c in target_checks(result.rows)]
    assert "int8 top1 >= 0.99" in whats and "int4 bytes_ratio <= 0.29" in whats
    assert "int8 decode >= 2x SSD raw read" in whats


def test_the_cli_prints_one_json_object_per_codec_and_history(tiny_model_dir, sharegpt, tmp_path):
    out = CliRunner().invoke(main, [
        "bench", "codecs", "--model", str(tiny_model_dir), "--histories", "256", "--score-tokens", "8",
        "--codecs", "none,int4", "--timing-runs", "1", "--dataset", str(sharegpt), "--no-ssd", "--json",
    ])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert [(r["codec"], r["history_tokens"]) for r in rows] == [("none", 256), ("int4", 256)]
    for key in ("codec", "history_tokens", "bytes_ratio", "top1", "kl", "encode_GBps", "decode_GBps",
                "ppl_ratio", "bytes_per_token", "tokens_scored"):
        assert all(key in r for r in rows)
    assert rows[0]["encode_GBps"] is None and rows[1]["decode_GBps"] > 0
    assert rows[1]["ssd_GBps"] is None  # --no-ssd

    bad = CliRunner().invoke(main, ["bench", "codecs", "--codecs", "int8,zip"])
    assert bad.exit_code != 0 and "comma-separated list of none" in bad.output


def test_a_history_past_the_model_positions_is_cut_to_whole_chunks():
    assert fit_histories([1024, 8192, 4096], 64, 256, 8192) == [(1024, 1024), (4096, 4096), (7936, 8192)]
    assert fit_histories([8192, 8150], 64, 256, 8192) == [(7936, 8150)]  # one row for both
    assert fit_histories([512], 64, 256, None) == [(512, 512)]
    with pytest.raises(ValueError, match="no whole chunk"):
        fit_histories([512], 64, 256, 300)


def test_the_text_is_whole_conversations_in_the_chat_template(tiny_model_dir, sharegpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, used = history_stream(tok, 600, str(sharegpt))
    text = tok.decode(ids)
    assert len(ids) >= 600 and used >= 2 and text.count("Question ") == used
    assert "<|start_header_id|>assistant<|end_header_id|>" in text
    with pytest.raises(ValueError, match="only"):
        history_stream(tok, 10**6, str(sharegpt))


@pytest.mark.parametrize("bad", [{"codecs": ()}, {"codecs": ("gzip",)}, {"score_tokens": 0}, {"histories": (8,)}])
def test_the_config_is_checked(bad):
    with pytest.raises(ValueError):
        CodecBenchConfig(**{"histories": (256,), **bad})


def test_ttft_measures_ssd_hits_per_codec(tiny_model_dir, tmp_path):
    config = TTFTBenchConfig(model=str(tiny_model_dir), histories=(256, 512), new_tokens=8, repeats=1,
                             directory=str(tmp_path), disk_codecs=("none", "int8"))
    rows = run_ttft_bench(config)

    for r, history in zip(rows, (256, 512)):
        assert [d.codec for d in r.disk] == ["none", "int8"]
        none, int8 = r.disk
        assert none.hit_tokens == int8.hit_tokens == r.hit_tokens_host == history
        assert r.same_output and none.same_tokens and none.max_logit_diff < 1e-3
        assert none.vs_first == 1 and int8.vs_first == pytest.approx(int8.ttft_s / none.ttft_s)
        assert 0 < int8.stored_bytes < none.stored_bytes
        assert int8.max_logit_diff > 0  # lossy: reported, not failed
    with pytest.raises(ValueError, match="distinct"):
        TTFTBenchConfig(disk_codecs=("int8", "int8"))


def test_ttft_cli_takes_a_disk_codec(tiny_model_dir, tmp_path):
    out = CliRunner().invoke(main, [
        "bench", "ttft", "--model", str(tiny_model_dir), "--histories", "256", "--new-tokens", "8",
        "--repeats", "1", "--disk-codec", "int4", "--dir", str(tmp_path), "--json",
    ])
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.stdout)
    assert [d["codec"] for d in row["disk"]] == ["int4"] and row["disk"][0]["hit_tokens"] == 256
