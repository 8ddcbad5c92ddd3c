"""Trace replay on traces the tests write themselves."""

import io
import json

import pytest
from click.testing import CliRunner

from kvtier.bench.replay import replay, sweep
from kvtier.bench.replay_config import ReplayConfig
from kvtier.bench.trace import TraceError, load_trace, parse_trace
from kvtier.bench.workload import WorkloadConfig, generate
from kvtier.cli import main


def line(ts: int, ids: list[int], input_length: int | None = None) -> str:
    n = input_length if input_length is not None else 512 * len(ids)
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": 1, "hash_ids": ids})


def sessions_trace(requests: int = 1500, seed: int = 1) -> str:
    out = io.StringIO()
    generate(WorkloadConfig(requests=requests, session_rate=2.0, think_mean_s=120.0,
                            system_tokens=1024, seed=seed), out)
    return out.getvalue()


def test_the_same_conversation_twice_hits_everything_but_the_partial_block():
    # The first prompt's last block (id 3) is partial; the follow-up's block 2 holds more
    # tokens, so it has a new id (4) and only the two full blocks hit.
    trace = parse_trace([line(0, [1, 2, 3], 1300), line(1000, [1, 2, 4, 5], 1800)])
    r = replay(trace, ReplayConfig(dram_blocks=100))
    assert r.hit_ratio_blocks == pytest.approx(2 / 7)
    assert r.hit_ratio_tokens == pytest.approx(1024 / 3100)
    assert 0 < r.prefill_saved < 1 and r.ttft_p99_s >= r.ttft_p50_s > 0


def test_layerwise_loading_overlaps_the_loads_with_the_new_tokens_compute():
    trace = parse_trace([line(0, [1, 2, 3]), line(1000, [1, 2, 3, 4, 5])])
    summed, overlapped = (ReplayConfig(dram_blocks=100, dram_read_GBps=0.5, layerwise=lw) for lw in (False, True))
    c, layers = summed.compute, summed.layout.num_layers
    work = c.prefill_flops(3 * 512, 5 * 512) / c.flops
    load = 3 * summed.load_s(0)
    assert load > work  # slow DRAM: the loads dominate, and the overlap hides the compute
    base = (c.prefill_flops(0, 3 * 512) + c.prefill_flops(0, 5 * 512)) / c.flops
    first = c.prefill_flops(0, 3 * 512) / c.flops
    for config, second in ((summed, work + load), (overlapped, load + work / layers)):
        r = replay(trace, config)
        assert r.prefill_saved == pytest.approx(1 - (first + second) / base)
        assert r.ttft_mean_s == pytest.approx((first + second) / 2)  # no queueing: TTFT is the service


def test_a_tiny_dram_with_an_ssd_serves_from_ssd_and_counts_its_bytes():
    trace = parse_trace([line(0, [1, 2, 3]), line(1, [9, 8, 7]), line(2, [1, 2, 3])])
    config = ReplayConfig(dram_blocks=3, ssd_blocks=10)
    r = replay(trace, config)
    assert r.hit_ratio_ssd == pytest.approx(3 / 9) and r.hit_ratio_dram == 0
    chunk = config.layout.chunk_bytes
    # 1, 2, 3 go down to make room for 9, 8, 7, which go down when 1, 2, 3 come back up.
    assert r.ssd_bytes_read == 3 * chunk and r.ssd_bytes_written == 6 * chunk
    no_ssd = replay(trace, ReplayConfig(dram_blocks=3))
    assert no_ssd.hit_ratio_blocks == 0 and no_ssd.prefill_saved == 0


def test_the_bounds_say_what_hits_from_dram_and_perfect_staging_would_have_saved():
    trace = parse_trace([line(0, [1, 2, 3]), line(1000, [9, 8, 7]), line(2000, [1, 2, 3, 4])])
    ssd_hit = replay(trace, ReplayConfig(dram_blocks=3, ssd_blocks=10, dram_read_GBps=20, ssd_read_GBps=0.5))
    assert ssd_hit.hit_ratio_ssd > 0 and ssd_hit.hit_ratio_dram == 0  # the third comes back from SSD
    # served as it arrived: staging alone could have had its three blocks in DRAM
    assert ssd_hit.prefill_saved < ssd_hit.prefill_saved_if_staged == ssd_hit.prefill_saved_if_in_dram
    in_dram = replay(trace, ReplayConfig(dram_blocks=100, dram_read_GBps=20))
    assert in_dram.prefill_saved == in_dram.prefill_saved_if_staged == in_dram.prefill_saved_if_in_dram
    assert in_dram.prefill_saved == pytest.approx(ssd_hit.prefill_saved_if_in_dram)


def test_the_dram_bound_moves_only_as_many_hits_into_dram_as_it_holds_layer_by_layer():
    # The third request hits six blocks on SSD; DRAM holds four: the bound reads four from
    # DRAM and two from SSD, layer by layer, as the replay charges a request.
    a = [1, 2, 3, 4, 5, 6]
    trace = parse_trace([line(0, a), line(1000, [9, 8, 7, 10, 11, 12]), line(2000, a + [13])])
    config = ReplayConfig(dram_blocks=4, ssd_blocks=20, ssd_read_GBps=0.5, layerwise=True)
    r = replay(trace, config)
    c, layers = config.compute, config.layout.num_layers
    full = [c.prefill_flops(0, 6 * 512) / c.flops] * 2 + [c.prefill_flops(0, 7 * 512) / c.flops]
    work = c.prefill_flops(6 * 512, 7 * 512) / c.flops
    load = 4 * config.load_s(0) + 2 * config.load_s(1)
    assert load > work
    third = load + work / layers
    assert r.prefill_saved_if_in_dram == pytest.approx(1 - (full[0] + full[1] + third) / sum(full))
    assert r.prefill_saved < r.prefill_saved_if_in_dram


def test_policies_rank_as_expected_on_multi_turn_sessions():
    trace = parse_trace(sessions_trace().splitlines())
    dram = trace.unique_blocks // 20
    saved = {p: replay(trace, ReplayConfig(policy=p, dram_blocks=dram)).prefill_saved
             for p in ("lru", "cost", "optimal")}
    assert saved["lru"] <= saved["optimal"] and saved["cost"] <= saved["optimal"]
    assert saved["lru"] > 0


def test_the_lookahead_prefetches_from_ssd_and_turns_ssd_hits_into_dram_hits():
    # Requests arrive together, so while one is served the next ones are queued.
    ids = [[10 * s + i for i in range(4)] for s in range(6)]
    lines = [line(0, i) for i in ids] + [line(10_000 + s, i) for s, i in enumerate(ids)]
    trace = parse_trace(lines)
    base = {"dram_blocks": 8, "ssd_blocks": 100, "instances": 1}
    lru = replay(trace, ReplayConfig(policy="lru", **base))
    ahead = replay(trace, ReplayConfig(policy="attentionstore", **base))
    assert lru.prefetch_accuracy is None
    assert ahead.hit_ratio_dram > lru.hit_ratio_dram
    assert ahead.prefetch_accuracy is not None and ahead.prefetch_accuracy > 0.5


def test_the_queue_prefetch_brings_in_the_prefix_of_a_request_longer_than_dram():
    # A's six blocks go to SSD behind B; when A comes back (seven blocks, more than DRAM's
    # four) queued behind C, the window prefetches as much of it as DRAM holds while C is
    # served (the live store's prefetch stops where DRAM has no room), instead of none of it.
    # (C's one-block prefill is too short for the prefetch on arrival to read more than one.)
    a = [1, 2, 3, 4, 5, 6]
    trace = parse_trace([line(0, a), line(1, [20, 21, 22, 23]), line(10_000, [30]), line(10_000, a + [7])])
    r = replay(trace, ReplayConfig(policy="attentionstore", dram_blocks=4, ssd_blocks=100, instances=1))
    dram, ssd = (round(share * trace.total_blocks) for share in (r.hit_ratio_dram, r.hit_ratio_ssd))
    assert dram + ssd == 6 and dram == 3  # C's own block takes DRAM's fourth while it is served


@pytest.mark.parametrize("busy_blocks, prefetched", [(8, 4), (1, 1)])
def test_a_request_arriving_while_the_server_is_busy_is_prefetched_as_far_as_its_wait_reads(
        busy_blocks, prefetched):
    # A comes back 1 ms after C started, so the window, which moved at C's start, never saw
    # it; the store prefetched it on arrival, in the background, for as long as it waited:
    # all four blocks behind C's eight-block prefill, one block (13 ms of SSD read) behind a
    # one-block prefill of about 20 ms.
    a, c = [1, 2, 3, 4], list(range(20, 20 + busy_blocks))
    trace = parse_trace([line(0, a), line(1, [10, 11, 12, 13]), line(10_000, c), line(10_001, a + [5])])
    for policy, dram in (("attentionstore", prefetched), ("lru", 0)):  # lru hears of no queue
        r = replay(trace, ReplayConfig(policy=policy, dram_blocks=4, ssd_blocks=100, instances=1))
        assert round(r.hit_ratio_dram * trace.total_blocks) == dram
        assert round((r.hit_ratio_dram + r.hit_ratio_ssd) * trace.total_blocks) == 4
        # the only hits were a queued request's: staging could not have helped, DRAM could
        assert r.prefill_saved_if_staged == r.prefill_saved
        assert (r.prefill_saved_if_in_dram > r.prefill_saved) == (dram < 4)


def test_a_sweep_runs_each_policy_at_each_capacity():
    trace = parse_trace(sessions_trace(300).splitlines())
    rows = sweep(trace, ReplayConfig(), ["lru", "cost"], (0.1, 0.5))
    assert [(r.policy, r.dram_blocks) for r in rows] == [
        ("lru", round(0.1 * trace.unique_blocks)), ("cost", round(0.1 * trace.unique_blocks)),
        ("lru", round(0.5 * trace.unique_blocks)), ("cost", round(0.5 * trace.unique_blocks))]
    assert rows[2].hit_ratio_blocks >= rows[0].hit_ratio_blocks


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: not valid JSON"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "line 2: 'hash_ids'"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "line 2: 'timestamp'"),
    ('{"timestamp": 1, "input_length": 5000, "output_length": 1, "hash_ids": [1]}', "line 2: 1 hash ids"),
    ('[1, 2]', "line 2: expected a JSON object"),
    # each of these used to pass (NaN figures, exit 0) or end in a traceback
    ('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "line 2: .*NaN"),
    ('{"timestamp": Infinity, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "line 2: .*Infinity"),
    ('{"timestamp": 1e400, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "line 2: 'timestamp'.*inf"),
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 5, "output_length": 1, "hash_ids": [1]}',
     "line 2: 'timestamp'.*401 digits"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1' + "0" * 400 + ', "hash_ids": [1]}',
     "line 2: 'output_length'.*401 digits"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1' + "0" * 5000 + ', "hash_ids": [1]}',
     "line 2: not a valid trace line"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "line 2: JSON nested too deeply"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1' + "0" * 60 + "]}",
     "line 2: hash id"),
])
def test_a_malformed_line_is_named_by_its_number(bad, message):
    with pytest.raises(TraceError, match=message):
        parse_trace([line(0, [1]), bad], name="t.jsonl")


def test_cli_replays_several_policies_as_json_and_plots_a_sweep(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(sessions_trace(300))
    runner = CliRunner()
    res = runner.invoke(main, ["replay", str(path), "--policy", "lru", "cost", "optimal",
                               "--dram-blocks", "40", "--ssd-blocks", "200", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [r["policy"] for r in rows] == ["lru", "cost", "optimal"]
    for r in rows:
        assert (r["dram_blocks"], r["ssd_blocks"]) == (40, 200)
        for key in ("hit_ratio_blocks", "hit_ratio_tokens", "prefill_saved", "ttft_mean_s",
                    "ttft_p50_s", "ttft_p99_s", "hit_ratio_dram", "hit_ratio_ssd",
                    "ssd_bytes_written", "ssd_bytes_read", "prefetch_accuracy"):
            assert key in r
    png = tmp_path / "sweep.png"
    res = runner.invoke(main, ["replay", str(path), "--policy", "lru,cost", "--sweep",
                               "--fractions", "0.1,0.3", "--plot", str(png), "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.output)) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_sizes_tiers_in_bytes_for_a_model_layout(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(sessions_trace(100))
    # Llama-3-8B-like, bf16: 128 KiB of KV a token, 64 MiB a 512-token block.
    res = CliRunner().invoke(main, ["replay", str(path), "--dram-bytes", "1GiB",
                                    "--ssd-bytes", "2GiB", "--json"])
    assert res.exit_code == 0, res.output
    assert (json.loads(res.output)[0]["dram_blocks"], json.loads(res.output)[0]["ssd_blocks"]) == (16, 32)


def test_cli_reports_a_bad_line_and_an_unknown_policy_clearly(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(line(0, [1]) + "\n\n" + '{"timestamp": 0}' + "\n")
    res = CliRunner().invoke(main, ["replay", str(path)])
    assert res.exit_code != 0 and "line 3" in res.output
    path.write_text(line(0, [1]) + "\n")
    res = CliRunner().invoke(main, ["replay", str(path), "--policy", "mru"])
    assert res.exit_code != 0 and "unknown policy 'mru'" in res.output
    res = CliRunner().invoke(main, ["replay", str(tmp_path / "missing.jsonl")])
    assert res.exit_code != 0 and "cannot read trace" in res.output
    for bad in ('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
                '[' * 100_000 + ']' * 100_000,
                '{"timestamp": 1, "input_length": 5, "output_length": 1' + "0" * 400 + ', "hash_ids": [1]}'):
        path.write_text(line(0, [1]) + "\n" + bad + "\n")
        res = CliRunner().invoke(main, ["replay", str(path)])
        assert res.exit_code not in (0, None) and "line 2" in res.output, res.output
        assert "Traceback" not in res.output and not isinstance(res.exception, (RecursionError, OverflowError))


def test_load_trace_reads_a_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(line(5, [1, 2]) + "\n" + line(0, [1]) + "\n")
    trace = load_trace(path)
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.005]  # served in arrival order
    assert trace.unique_blocks == 2


def test_a_compressed_ssd_holds_more_blocks_and_reads_fewer_bytes():
    trace = parse_trace([line(0, [1, 2, 3]), line(1, [9, 8, 7]), line(2, [4, 5, 6]), line(3, [1, 2, 3])])
    raw = replay(trace, ReplayConfig(dram_blocks=3, ssd_blocks=3))
    assert raw.hit_ratio_ssd == 0  # 1, 2, 3 were pushed off the SSD by 9, 8, 7
    coded = replay(trace, ReplayConfig(dram_blocks=3, ssd_blocks=3, ssd_codec="int8",
                                       ssd_codec_ratio=0.5, ssd_decode_GBps=10.0))
    assert coded.ssd_blocks_held == 6 and coded.ssd_codec == "int8"
    assert coded.hit_ratio_ssd == pytest.approx(3 / 12)
    chunk = ReplayConfig().layout.chunk_bytes
    assert coded.ssd_bytes_read == 3 * chunk // 2  # stored bytes
    assert coded.prefill_saved > raw.prefill_saved
    with pytest.raises(ValueError, match="ssd_codec_ratio"):
        ReplayConfig(ssd_codec="int8")  # a codec needs its ratio
    with pytest.raises(ValueError, match="ssd_codec_ratio"):
        ReplayConfig(ssd_codec_ratio=0.5)


def test_cli_takes_the_codec_ratio_kvtier_measures_for_the_layout(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(sessions_trace(200))
    runner = CliRunner()
    rows = {}
    for codec in ("none", "int8", "int4"):
        res = runner.invoke(main, ["replay", str(path), "--dram-blocks", "20", "--ssd-blocks", "100",
                                   "--ssd-codec", codec, "--decode-gbps", "8", "--json"])
        assert res.exit_code == 0, res.output
        rows[codec] = json.loads(res.output)[0]
    assert rows["none"]["ssd_blocks_held"] == 100
    assert 190 <= rows["int8"]["ssd_blocks_held"] <= 200  # bf16 -> int8 and its scales
    assert 350 <= rows["int4"]["ssd_blocks_held"] <= 400
    assert rows["int8"]["hit_ratio_blocks"] >= rows["none"]["hit_ratio_blocks"]


def session_line(ts: int, ids: list[int], session: int, output: int = 1) -> str:
    return json.dumps({"timestamp": ts, "input_length": 512 * len(ids), "output_length": output,
                       "hash_ids": ids, "session_id": session})


def test_a_closed_loop_sends_the_next_turn_a_think_time_after_the_reply():
    import dataclasses

    from kvtier.bench.replay import replay_served

    trace = parse_trace([session_line(0, [1, 2], 0, output=100), session_line(10, [7], 1, output=100),
                         session_line(5000, [1, 2, 3], 0)])
    trace = dataclasses.replace(trace, requests=[trace.requests[0], trace.requests[1],
                                                 dataclasses.replace(trace.requests[2], think_s=5.0)])
    config = ReplayConfig(dram_blocks=100, instances=1, closed_loop=True, decode_s_per_token=0.01)
    result, served = replay_served(trace, config)
    c = config.compute
    first = c.prefill_s(0, 1024) + 1.0  # prefill, then 100 reply tokens at 10 ms
    second_done = max(first, 0.01) + c.prefill_s(0, 512) + 1.0  # session 1 waited for the instance
    assert [r.session_id for r in served.requests] == [0, 1, 0]
    assert served.requests[2].arrival_s == pytest.approx(first + 5.0)  # not at its own 5 s
    assert served.requests[2].arrival_s > second_done  # so it found the instance free
    assert result.ttft_mean_s == pytest.approx(
        (c.prefill_s(0, 1024) + (second_done - 1.0 - 0.01) + c.prefill_s(1024, 1536) + 2 * config.load_s(0)) / 3)
    open_loop = replay_served(trace, dataclasses.replace(config, closed_loop=False))[1]
    assert open_loop.requests[2].arrival_s == pytest.approx(5.0)


def test_a_closed_loop_refuses_the_offline_bounds_and_a_trace_without_sessions():
    sessions = parse_trace([session_line(0, [1], 0), session_line(1000, [1, 2], 0)])
    with pytest.raises(ValueError, match="replay it on served_trace"):
        replay(sessions, ReplayConfig(policy="optimal", closed_loop=True))
    with pytest.raises(ValueError, match="needs a trace that names sessions"):
        replay(parse_trace([line(0, [1])]), ReplayConfig(closed_loop=True))
    with pytest.raises(ValueError, match="decode_s_per_token must be >= 0"):
        ReplayConfig(decode_s_per_token=-1.0)
