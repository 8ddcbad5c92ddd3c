"""Session hints: the fields a request may carry, and the error that names a bad one."""

import pytest

from kvtier.core.session_hints import DEFAULT_RETAIN_S, HintError, SessionHint, parse_hint


def test_a_hint_reads_back_from_its_wire_form():
    hint = parse_hint({"session": "agent-17", "retain_s": 600, "return_s": 4.5, "tenant": "acme"}, internal=True)
    assert hint == SessionHint("agent-17", 600.0, 4.5, False, "acme")
    assert parse_hint(hint.as_dict(), internal=True) == hint
    zero = SessionHint("s", 0.0, 0.0)  # retain_s 0 with return_s is kept, not read back as 300
    assert parse_hint(zero.as_dict()) == zero
    assert parse_hint({"session": "s", "return_s": 2}).retain_s == DEFAULT_RETAIN_S
    assert parse_hint({"session": "s"}) == SessionHint("s")
    assert parse_hint({"session": "s", "done": True}).done


@pytest.mark.parametrize(("raw", "field"), [
    ("agent-1", "kv_transfer_params.kvtier must be an object"),
    ({"retain_s": 5}, "kv_transfer_params.kvtier.session"),
    ({"session": ""}, "kv_transfer_params.kvtier.session"),
    ({"session": "has space"}, "kv_transfer_params.kvtier.session"),
    ({"session": "x" * 129}, "kv_transfer_params.kvtier.session"),
    ({"session": "s", "retain_s": "600"}, "kv_transfer_params.kvtier.retain_s"),
    ({"session": "s", "retain_s": -1}, "kv_transfer_params.kvtier.retain_s"),
    ({"session": "s", "retain_s": float("nan")}, "kv_transfer_params.kvtier.retain_s"),
    ({"session": "s", "retain_s": True}, "kv_transfer_params.kvtier.retain_s"),
    ({"session": "s", "return_s": 1e9}, "kv_transfer_params.kvtier.return_s"),
    ({"session": "s", "retain_s": 5, "return_s": 10}, "kv_transfer_params.kvtier.return_s"),
    ({"session": "s", "done": "yes"}, "kv_transfer_params.kvtier.done"),
    ({"session": "s", "done": True, "retain_s": 5}, "kv_transfer_params.kvtier.done"),
    ({"session": "s", "tenant": "acme"}, "kv_transfer_params.kvtier.tenant is not a hint field"),
    ({"session": "s", "ttl": 5}, "kv_transfer_params.kvtier.ttl is not a hint field"),
])
def test_a_malformed_hint_is_refused_naming_its_field(raw, field):
    """(A client never names the tenant whose quota it counts against: the connector does.)"""
    with pytest.raises(HintError, match=field.replace(".", r"\.")):
        parse_hint(raw)


def test_the_connectors_form_may_name_the_tenant_and_only_a_tenant_more():
    with pytest.raises(HintError, match=r"hint\.tenant must be"):
        parse_hint({"session": "s", "tenant": 7}, "hint", internal=True)
