"""vLLM's API server answers a malformed session hint with HTTP 400 naming the field; anything
else passes through untouched (the ASGI middleware driven by the ASGI protocol itself)."""

import asyncio
import json

from kvtier.engines.vllm.hint_check import HintCheck


def _call(path: str, body: bytes, chunks: int = 1, method: str = "POST"):
    seen: dict[str, object] = {}

    async def app(scope, receive, send):  # the server behind: echoes the body it received
        got = b""
        while True:
            message = await receive()
            got += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"] = got
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parts = [body[i::chunks] for i in range(chunks)] if chunks == 1 else \
        [body[i * len(body) // chunks:(i + 1) * len(body) // chunks] for i in range(chunks)]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(HintCheck(app)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), seen.get("body")


def test_a_malformed_hint_gets_a_400_naming_the_field_and_never_reaches_vllm():
    body = json.dumps({"model": "m", "prompt": "hi", "kv_transfer_params": {"kvtier": {"session": "s", "retain_s": "x"}}})
    status, reply, reached = _call("/v1/completions", body.encode(), chunks=3)
    assert status == 400 and reached is None
    error = json.loads(reply)["error"]
    assert error["param"] == "kv_transfer_params.kvtier.retain_s" and error["code"] == 400
    assert "retain_s must be a number of seconds" in error["message"]


def test_good_hints_and_everything_else_pass_through_untouched():
    good = json.dumps({"messages": [], "kv_transfer_params": {"kvtier": {"session": "s", "return_s": 2}}}).encode()
    for path, body, method in [("/v1/chat/completions", good, "POST"), ("/v1/completions", b"not json", "POST"),
                               ("/v1/completions", b'{"kv_transfer_params": {"kvtier": "skip"}}', "POST"),
                               ("/v1/completions", b'{"kv_transfer_params": {"kvtier": null}}', "POST"),
                               ("/v1/models", b"", "GET"),
                               ("/tokenize", b'{"kv_transfer_params": {"kvtier": 5}}', "POST")]:
        status, reply, reached = _call(path, body, chunks=2 if len(body) > 4 else 1, method=method)
        assert (status, reply, reached) == (200, b"ok", body), path


def test_an_escaped_key_is_checked_and_the_param_is_the_whole_field_name():
    body = b'{"prompt": "hi", "kv_transfer_params": {"kv\\u0074ier": {"session": "s", "retain_s": -1}}}'
    status, reply, reached = _call("/v1/completions", body)
    assert status == 400 and reached is None  # JSON spells "kvtier" there
    assert json.loads(reply)["error"]["param"] == "kv_transfer_params.kvtier.retain_s"
    body = json.dumps({"kv_transfer_params": {"kvtier": {"session": "s", "x-y": 1}}}).encode()
    status, reply, _ = _call("/v1/completions", body)
    assert status == 400 and json.loads(reply)["error"]["param"] == "kv_transfer_params.kvtier.x-y"
