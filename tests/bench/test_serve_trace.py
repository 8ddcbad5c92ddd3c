"""A Mooncake trace served by a real engine: rows checked line by line, shrunk into prompts that
share exactly the trace's leading blocks, sent open loop at their arrival times, and recorded as
the serve benchmark's turns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from kvtier.bench.serve_report import Run, build_report
from kvtier.bench.serve_trace import (
    TraceRecord,
    TraceRow,
    TraceScale,
    as_turn_records,
    in_family_sample,
    lateness_stats,
    load_trace,
    run_trace,
    scaled_input_length,
    token_pool,
    trace_prompts,
    trace_workload,
)
from kvtier.bench.trace import TraceError


def row(ts: float, ids: list[int], input_length: int | None = None, output: int = 8) -> dict:
    return {"timestamp": ts, "input_length": 512 * len(ids) if input_length is None else input_length,
            "output_length": output, "hash_ids": ids}


def write(tmp_path: Path, rows: list[dict | str], end: str = "\n") -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + end)
    return path


# -- loading ----------------------------------------------------------------------------------

def test_rows_load_in_arrival_order_with_blank_lines_skipped_and_skip_and_limit_in_file_order(tmp_path):
    path = write(tmp_path, [row(0, [0, 1], 1000), "", row(2000, [0, 2]), "  ", row(1000, [3], 1, 0),
                            row(3000, [4])])
    rows = load_trace(path)
    assert [r.line for r in rows] == [1, 5, 3, 6]
    assert rows[0] == TraceRow(1, 0.0, 1000, 8, (0, 1))
    assert [r.line for r in load_trace(path, skip=1, limit=2)] == [5, 3]
    with pytest.raises(ValueError, match="limit"):
        load_trace(path, limit=0)


@pytest.mark.parametrize(("bad", "said"), [
    ({"input_length": 512, "output_length": 1, "hash_ids": [1]}, "missing field 'timestamp'"),
    (row(0, [1]) | {"output_length": None}, "'output_length' must be a non-negative integer"),
    (row(0, [1]) | {"output_length": -1}, "'output_length' must be a non-negative integer"),
    (row(0, [1]) | {"input_length": 3.5}, "'input_length' must be a non-negative integer"),
    (row(0, [1]) | {"input_length": True}, "'input_length' must be a non-negative integer"),
    (row(-1, [1]), "'timestamp' must be a finite, non-negative number"),
    (row("0", [1]), "'timestamp'"),
    (row(0, [1]) | {"hash_ids": "1"}, "'hash_ids' must be a list of non-negative integers"),
    (row(0, [1, -2]), "'hash_ids' must be a list of non-negative integers"),
    (row(0, [1, True]), "'hash_ids' must be a list of non-negative integers"),
    (row(0, [1, 2], 512), "'input_length' 512 does not fit 2 hash ids of 512-token blocks"),
    (row(0, [1, 2], 1025), "'input_length' 1025 does not fit 2 hash ids"),
    (row(0, [], 0), "'input_length' must be positive"),
    ([1, 2], "expected a JSON object"),
])
def test_a_bad_row_names_the_file_its_line_and_the_field(tmp_path, bad, said):
    path = write(tmp_path, [row(0, [0]), bad, row(1, [0])])
    with pytest.raises(TraceError, match=f"trace.jsonl, line 2: .*{said}") as err:
        load_trace(path)
    assert isinstance(err.value, ValueError) and str(path) in str(err.value)


def test_a_truncated_last_line_is_reported_as_truncated_and_bad_json_elsewhere_as_invalid(tmp_path):
    whole = json.dumps(row(1, [0, 1]))
    path = write(tmp_path, [json.dumps(row(0, [0])), whole[: len(whole) // 2]], end="")
    with pytest.raises(TraceError, match="line 2: truncated"):
        load_trace(path)
    assert len(load_trace(path, limit=1)) == 1  # reading stops at the limit
    path = write(tmp_path, [json.dumps(row(0, [0])), "{oops", json.dumps(row(1, [0]))])
    with pytest.raises(TraceError, match="line 2: not valid JSON"):
        load_trace(path)
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, ["", ""]))


@pytest.mark.parametrize(("field", "value"), [
    ("block_tokens", 0), ("block_tokens", 1.5), ("source_block", -512), ("max_output_tokens", 0),
    ("time_scale", -1.0), ("time_scale", float("inf")), ("max_input_tokens", 0), ("max_input_tokens", True),
])
def test_a_bad_scale_names_its_field(field, value):
    with pytest.raises(ValueError, match=f"TraceScale.{field}"):
        TraceScale(**{field: value})


# -- prompts ----------------------------------------------------------------------------------

def test_prompts_share_exactly_the_leading_blocks_their_rows_share():
    scale = TraceScale()  # 512 -> 16 tokens
    a = TraceRow(1, 0, 1200, 4, (0, 1, 2))       # last block 176 tokens -> round(5.5) = 6
    b = TraceRow(2, 0, 2048, 4, (0, 1, 3, 4))
    c = TraceRow(3, 0, 513, 4, (0, 5))           # last block 1 token -> at least 1
    assert [scaled_input_length(r, scale) for r in (a, b, c)] == [38, 64, 17]
    pa, pb, pc = trace_prompts([a, b, c], scale, 49152)
    assert [len(p) for p in (pa, pb, pc)] == [38, 64, 17]
    assert pa[:32] == pb[:32] and pa[32:38] != pb[32:38] and pc[:16] == pa[:16] and pc[16] != pa[16]
    assert trace_prompts([b], scale, 49152) == [pb]  # the same id gives the same tokens
    assert trace_prompts([b], scale, 49152, seed=1) != [pb]
    assert all(1000 <= t < 48152 for p in (pa, pb, pc) for t in p)


def test_the_same_ids_give_the_same_tokens_in_another_process():
    code = ("from kvtier.bench.serve_trace import TraceRow, TraceScale, trace_prompts;"
            "print(trace_prompts([TraceRow(1, 0, 1000, 1, (7, 123456789012345678901234567890))],"
            " TraceScale(), 32000, seed=3))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    here = trace_prompts([TraceRow(1, 0, 1000, 1, (7, 123456789012345678901234567890))], TraceScale(), 32000, seed=3)
    assert out.stdout.strip() == str(here)


def test_tokens_avoid_special_ids_and_a_tiny_vocabulary_is_used_whole():
    pool = token_pool(49152)
    assert pool[0] == 1000 and pool[-1] == 48151
    assert token_pool(1_000_000)[0] == 10_000
    tiny = token_pool(100, special_ids=[0, 1, 2, 3])
    assert tiny[0] == 4 and tiny[-1] == 99 and len(tiny) == 96
    prompts = trace_prompts([TraceRow(1, 0, 4096, 1, tuple(range(8)))], TraceScale(), 100, special_ids=[0, 1, 2, 3])
    assert len(prompts[0]) == 128 and min(prompts[0]) >= 4
    with pytest.raises(ValueError, match="fewer than 2"):
        token_pool(3, special_ids=[0, 1])


# -- as the benchmark's turns ----------------------------------------------------------------

def record(i: int, ttft: float, reply: str = "r") -> TraceRecord:
    return TraceRecord(i, 0.1 * i, 0.0, ttft, 0.01, 40, 16, 4, reply)


def test_a_rows_turn_counts_the_earlier_rows_that_open_with_its_first_block_and_the_report_splits_them():
    rows = [TraceRow(i + 1, i, 512, 4, (first,)) for i, first in enumerate([5, 7, 5, 5, 9])]
    turns = as_turn_records(rows, [record(i, 0.5) for i in reversed(range(5))])
    assert [(t.conversation, t.turn) for t in turns] == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 0)]
    runs = [Run(name, 0, as_turn_records(rows, [record(i, ttft if i in (0, 1, 4) else ttft / 5)
                                                for i in range(5)]), 1.0, None, None, None)
            for name, ttft in (("vllm", 1.0), ("kvtier", 0.5))]
    report = build_report({}, {}, runs, {})
    assert report.matched_requests == 5
    assert report.summary["vllm"]["ttft_first_mean_s"]["median"] == pytest.approx(1.0)
    assert report.summary["vllm"]["ttft_later_mean_s"]["median"] == pytest.approx(0.2)
    assert report.ratios["kvtier/vllm"]["ttft_first_mean_s"] == pytest.approx(0.5)
    assert all(r.same_replies_as_vllm for r in report.results)
    with pytest.raises(ValueError, match="record 5 has no row"):
        as_turn_records(rows, [record(5, 1.0)])
    assert lateness_stats([]) == {"p50": None, "p99": None, "max": None}


def test_a_workload_shrinks_prompts_caps_replies_skips_long_rows_and_says_so(tmp_path):
    path = write(tmp_path, [row(10_000, [0, 1], 700, output=100), row(10_500, [0, 2, 3], 1500, output=0),
                            row(11_000, list(range(10, 30))), row(12_000, [0, 4], 1024, output=5)])
    work = trace_workload(path, TraceScale(time_scale=2.0, max_input_tokens=100, max_output_tokens=64), 32000, skip=0)
    assert [r.line for r in work.rows] == [1, 2, 4] and work.skipped == 1  # 20 blocks: 320 tokens
    assert [len(p) for p in work.prompts] == [22, 47, 32]
    assert work.outputs == [64, 1, 5] and work.capped == 1
    assert work.arrivals_s == [0.0, 1.0, 4.0]
    assert work.final_tokens == [86, 48, 37]
    assert work.prompts[0][:16] == work.prompts[1][:16] == work.prompts[2][:16]
    assert work.description == ("3 requests of trace.jsonl, blocks 512->16 tokens, times x2 (4 s), replies "
                                "capped at 64 tokens (1 capped), 1 skipped over 100 prompt tokens")
    assert [t.turn for t in work.turn_records([record(i, 0.1) for i in range(3)])] == [0, 1, 2]
    with pytest.raises(ValueError, match="every one of its 4 rows is longer"):
        trace_workload(path, TraceScale(max_input_tokens=1), 32000)
    exact = trace_workload(path, TraceScale(max_input_tokens=100), 32000)  # by default: every reply its length
    assert exact.outputs == [100, 1, 5] and exact.capped == 0 and "every reply its row's length" in exact.description


def test_a_family_sample_keeps_whole_prefix_families_and_about_its_share_of_them(tmp_path):
    rows = [row(1000 * i, [i % 40, 100 + i]) for i in range(400)]  # 40 families of 10 rows
    path = write(tmp_path, rows)
    work = trace_workload(path, TraceScale(), 32000, families=0.25)
    kept = {r.hash_ids[0] for r in work.rows}
    assert 4 <= len(kept) <= 18 and len(work.rows) == 10 * len(kept)  # whole families only
    assert "prefix families sampled 0.25" in work.description
    first = min(kept)  # family f's first row arrives at f s: arrivals count from the first kept
    assert work.rows[0].timestamp_ms == 1000 * first and work.arrivals_s[1] == 1.0 * (sorted(kept)[1] - first)
    limited = trace_workload(path, TraceScale(), 32000, families=0.25, limit=3)
    assert [r.line for r in limited.rows] == [r.line for r in work.rows[:3]]  # sampled, then limited
    again = [r for r in load_trace(path) if in_family_sample(r, 0.25)]
    assert [r.line for r in again] == [r.line for r in work.rows]  # stable: a hash, not a draw
    assert len(trace_workload(path, TraceScale(), 32000, families=1.0).rows) == 400
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="families must be a share"):
            trace_workload(path, TraceScale(), 32000, families=bad)


def test_a_workload_from_a_tokenizer_leaves_its_special_tokens_out(tmp_path):
    pytest.importorskip("transformers")
    from kvtier.engines.default_model import build_tokenizer

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    work = trace_workload(write(tmp_path, [row(0, list(range(16)))]), TraceScale(), tmp_path / "tok")
    special = set(tok.all_special_ids)
    assert special and len(work.prompts[0]) == 256
    assert not special & set(work.prompts[0]) and max(work.prompts[0]) < len(tok)


# -- the client, against a fake OpenAI server -------------------------------------------------

class FakeCompletions(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` one-token chunks after ``delay_s``, then usage; 500 for prompt [13].
    Each test serves a subclass of its own (its own ``seen`` and ``delay_s``)."""

    delay_s: ClassVar[float] = 0.3
    seen: ClassVar[list[tuple[float, dict]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((time.perf_counter(), body | {"path": self.path}))
        if body["prompt"] == [13]:
            self.send_error(500, "boom")
            return
        time.sleep(self.delay_s)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        base = {"id": "c", "object": "text_completion", "created": 0, "model": body["model"]}
        for k in range(n):
            choice = {"index": 0, "text": f"t{k} ", "logprobs": None, "finish_reason": "length" if k == n - 1 else None}
            self.wfile.write(f"data: {json.dumps(base | {'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        prompt = len(body["prompt"])
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2}}
        self.wfile.write(f"data: {json.dumps(base | {'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_server():
    pytest.importorskip("openai")
    handler = type("Handler", (FakeCompletions,), {"seen": [], "delay_s": 0.3})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", handler
    server.shutdown()
    server.server_close()


def test_requests_go_out_at_their_arrival_times_without_waiting_for_replies(fake_server):
    url, handler = fake_server
    prompts, outputs, arrivals = [[5, 6, 7, 8], [5, 6, 9], [1]], [3, 1, 2], [0.0, 0.05, 0.1]
    records = run_trace(url, "m", prompts, outputs, arrivals)
    assert [r.index for r in records] == [0, 1, 2]
    assert all(r.sent_s < 0.25 for r in records)  # every one sent before the first reply (0.3 s)
    assert all(abs(r.lateness_s) < 0.05 and r.ttft_s >= 0.25 for r in records)
    assert [(r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in records] == [(4, 2, 3), (3, 1, 1), (1, 0, 2)]
    assert records[0].reply == "t0 t1 t2 " and records[1].tpot_s is None and records[0].tpot_s > 0
    bodies = sorted((b for _, b in handler.seen), key=lambda b: len(b["prompt"]), reverse=True)
    assert bodies[0]["path"] == "/v1/completions" and bodies[0]["prompt"] == [5, 6, 7, 8]
    assert {k: bodies[0][k] for k in ("max_tokens", "min_tokens", "ignore_eos", "temperature", "stream",
                                      "skip_special_tokens", "spaces_between_special_tokens")} == {
        "max_tokens": 3, "min_tokens": 3, "ignore_eos": True, "temperature": 0, "stream": True,
        "skip_special_tokens": False, "spaces_between_special_tokens": False}
    assert bodies[0]["stream_options"] == {"include_usage": True}


def test_a_cap_on_requests_in_flight_holds_the_next_back_and_shows_as_lateness(fake_server):
    url, handler = fake_server
    handler.delay_s = 0.15
    records = run_trace(url, "m", [[1, 2], [3, 4]], [1, 1], [0.0, 0.0], max_in_flight=1)
    assert records[1].sent_s >= records[0].sent_s + 0.15 and records[1].lateness_s >= 0.15
    assert lateness_stats(records)["max"] == pytest.approx(records[1].lateness_s)


def test_a_failed_request_raises_naming_it(fake_server):
    with pytest.raises(RuntimeError, match="trace request 1 .* failed"):
        run_trace(fake_server[0], "m", [[1], [13]], [1, 1], [0.0, 0.0])


@pytest.mark.parametrize(("args", "kwargs", "said"), [
    (([[1]], [1, 2], [0.0]), {}, "one output and one arrival per prompt"),
    (([[]], [1], [0.0]), {}, "every prompt must hold a token"),
    (([[1]], [0], [0.0]), {}, "every prompt must hold a token"),
    (([[1]], [1], [-1.0]), {}, "arrivals must be finite"),
    (([[1]], [1], [0.0]), {"max_in_flight": 0}, "max_in_flight"),
])
def test_run_trace_refuses_a_plan_it_cannot_send(args, kwargs, said):
    with pytest.raises(ValueError, match=said):
        run_trace("http://127.0.0.1:1/v1", "m", *args, **kwargs)
