"""The Mooncake trace format: an optional session id per line, and block ids for growing prompts."""

import io
import json

import pytest

from kvtier.bench.trace import BlockIds, TraceError, parse_trace, write_request


def line(ts: int, ids: list[int], **extra) -> str:
    return json.dumps({"timestamp": ts, "input_length": 512 * len(ids), "output_length": 1,
                       "hash_ids": ids, **extra})


def test_a_session_id_is_kept_when_a_line_has_one_and_none_otherwise():
    trace = parse_trace([line(0, [1], session_id=7), line(1, [2]), line(2, [3], session_id="a")])
    assert [r.session_id for r in trace.requests] == [7, None, "a"]
    plain = parse_trace([line(0, [1]), line(1, [1, 2])])
    assert all(r.session_id is None for r in plain.requests) and plain.unique_blocks == 2


@pytest.mark.parametrize("bad", [[1], True, 1.5, {"s": 1}])
def test_a_session_id_that_is_neither_an_integer_nor_a_string_names_its_line(bad):
    with pytest.raises(TraceError, match="line 2: 'session_id'"):
        parse_trace([line(0, [1]), line(1, [2], session_id=bad)])


def test_write_request_adds_the_session_only_when_given():
    out = io.StringIO()
    write_request(out, 5, 600, 3, [0, 1])
    write_request(out, 6, 600, 3, [0, 2], session_id=4)
    first, second = (json.loads(x) for x in out.getvalue().splitlines())
    assert "session_id" not in first and second["session_id"] == 4
    assert [r.session_id for r in parse_trace(out.getvalue().splitlines()).requests] == [None, 4]


def test_block_ids_keep_a_sessions_full_blocks_and_give_each_partial_block_a_fresh_id():
    blocks = BlockIds()
    shared = blocks.fresh(2)  # a prompt both sessions open with
    a, b = list(shared), list(shared)
    assert blocks.prompt(a, 1300) == [0, 1, 2]  # two full blocks, then a partial one: fresh
    assert blocks.prompt(b, 1024) == [0, 1]  # exactly two blocks: no partial one
    assert blocks.prompt(a, 1700) == [0, 1, 3, 4]  # block 2 is full now: a new id, kept after
    assert blocks.prompt(a, 2100) == [0, 1, 3, 5, 6]
    assert a == [0, 1, 3, 5] and blocks.issued == 7
