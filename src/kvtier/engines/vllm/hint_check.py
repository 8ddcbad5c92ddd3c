"""vLLM's API server refuses a malformed session hint with HTTP 400 naming the field.

``kvtier serve`` adds this middleware (``--middleware kvtier.engines.vllm.hint_check.HintCheck``;
add it yourself to a ``vllm serve`` of your own). It reads the JSON body of every POST to an
OpenAI endpoint that takes ``kv_transfer_params`` and checks ``kv_transfer_params.kvtier`` with
:func:`kvtier.core.session_hints.parse_hint`; a bad hint gets OpenAI's error shape::

    400 {"error": {"message": "kv_transfer_params.kvtier.retain_s must be a number ...",
                   "type": "BadRequestError", "param": "kv_transfer_params.kvtier.retain_s",
                   "code": 400}}

Anything else -- another path, a body that is not JSON, a request without a hint, the string
``"skip"`` -- passes through untouched (vLLM answers it as before). A pure ASGI middleware: the
body is read once and handed on as received, streaming replies are not wrapped.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvtier.core.session_hints import HintError, parse_hint

__all__ = ["CHECKED_PATHS", "HintCheck", "hint_error"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CHECKED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_BODY = 64 << 20
"""Bodies larger than this are passed on unchecked (vLLM applies its own limits)."""


def hint_error(body: bytes) -> HintError | None:
    """The error of the hint in a request body (None: no hint, null, a good one, or not JSON).
    A body without the word ``"kvtier"`` and without escapes (which could spell it) is not
    parsed at all (vLLM parses it anyway)."""
    if b'"kvtier"' not in body and b"\\u" not in body:
        return None
    try:
        req = json.loads(body)
    except ValueError:
        return None
    params = req.get("kv_transfer_params") if isinstance(req, dict) else None
    if not isinstance(params, dict) or params.get("kvtier") in (None, "skip"):
        return None
    try:
        parse_hint(params["kvtier"])
    except HintError as exc:
        return exc
    return None


class HintCheck:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size, more = 0, True
        while more and size <= MAX_BODY:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            more = bool(message.get("more_body", False))
        if not more and messages and messages[-1]["type"] == "http.request":
            error = hint_error(b"".join(m.get("body", b"") for m in messages))
            if error is not None:
                await _bad_request(send, error)
                return
        replay = iter(messages)

        async def replayed() -> Message:
            for message in replay:
                return message
            return await receive()

        await self.app(scope, replayed, send)


async def _bad_request(send: Send, error: HintError) -> None:
    body = json.dumps({"error": {"message": str(error), "type": "BadRequestError", "param": error.field,
                                 "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
