"""Session hints: what a client that knows its sessions may tell the cache, and their checks.

An agent framework knows what no cache can guess: this session comes back when its tool
returns, that one is finished. A request says so in ``kv_transfer_params`` (vLLM's OpenAI
server passes the field to the KV connector untouched)::

    {"kv_transfer_params": {"kvtier": {"session": "agent-17", "retain_s": 600, "return_s": 4.0}}}
    {"kv_transfer_params": {"kvtier": {"session": "agent-17", "done": true}}}

Fields (every one optional but ``session``; no others):

- ``session`` (str, 1-128 printable ASCII characters): the session this request continues.
- ``retain_s`` (number, 0-86400): keep the session's chunks that long after this request,
  ranked after every unhinted chunk for eviction (within the tenant's quota). Default
  :data:`DEFAULT_RETAIN_S` when ``return_s`` is given, else 0 (named only).
- ``return_s`` (number, 0-86400, at most ``retain_s``): the session's next request is expected
  that many seconds after this one's reply (a tool's latency): its chunks are brought into DRAM
  shortly before, from SSD or the remote tier.
- ``done`` (bool): the session ends with this request: its chunks are evicted first (a chunk
  another live session shares stays where that session needs it). ``done`` with ``retain_s``
  or ``return_s`` is refused.

Whose quota a hint counts against is not the client's to say: the request's ``cache_salt``
(vLLM's per-tenant field; the connector sets :attr:`SessionHint.tenant` from it), else the
tenant the engine's namespace is bound to.

A malformed hint is refused with :class:`HintError` naming the field: ``kvtier serve``'s API
middleware answers HTTP 400 before vLLM sees the request
(:mod:`kvtier.engines.vllm.hint_check`); a connector given one anyway serves the request
without it, counted and logged. The string ``"skip"`` in place of the object is the older
opt-out (:func:`kvtier.engines.vllm.request_state.skipped`), not a hint.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["DEFAULT_RETAIN_S", "MAX_HINT_S", "HintError", "SessionHint", "parse_hint"]

MAX_HINT_S = 86400.0
"""The longest ``retain_s`` or ``return_s`` accepted (a day)."""
DEFAULT_RETAIN_S = 300.0
"""``retain_s`` when a hint gives ``return_s`` alone."""
_FIELDS = ("session", "retain_s", "return_s", "done")
_SESSION = re.compile(r"[\x21-\x7e]{1,128}")
_TENANT = re.compile(r"[\x20-\x7e]{0,64}")


class HintError(ValueError):
    """A malformed hint; the message names the field (``kv_transfer_params.kvtier.<field>``),
    :attr:`field` is that path alone (an API error's ``param``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class SessionHint:
    session: str
    retain_s: float = 0.0
    return_s: float | None = None
    done: bool = False
    tenant: str | None = None
    """Set by the connector (the request's ``cache_salt``), never by a client's request."""

    def as_dict(self) -> dict[str, object]:
        """The wire form (what :func:`parse_hint` reads back)."""
        out: dict[str, object] = {"session": self.session}
        if self.retain_s or self.return_s is not None:  # (0 with return_s: not the default)
            out["retain_s"] = self.retain_s
        if self.return_s is not None:
            out["return_s"] = self.return_s
        if self.done:
            out["done"] = True
        if self.tenant is not None:
            out["tenant"] = self.tenant
        return out


def _seconds(raw: dict[str, object], name: str, where: str) -> float | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_HINT_S:
        raise HintError(f"{where}.{name} must be a number of seconds from 0 to {MAX_HINT_S:.0f}, got {value!r}",
                        f"{where}.{name}")
    return float(value)


def parse_hint(raw: object, where: str = "kv_transfer_params.kvtier", *, internal: bool = False) -> SessionHint:
    """Check a hint (the object under ``kv_transfer_params.kvtier``). :class:`HintError` names
    the first bad field. ``internal``: the connector's form for the daemon, which may carry
    ``tenant``."""
    if not isinstance(raw, dict):
        raise HintError(f"{where} must be an object with a session (or the string \"skip\"), "
                        f"got {type(raw).__name__}", where)
    known = (*_FIELDS, "tenant") if internal else _FIELDS
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise HintError(f"{where}.{unknown[0]} is not a hint field (known: {', '.join(known)})",
                        f"{where}.{unknown[0]}")
    session = raw.get("session")
    if not isinstance(session, str) or not _SESSION.fullmatch(session):
        raise HintError(f"{where}.session must be 1-128 printable ASCII characters without spaces, "
                        f"got {session!r}", f"{where}.session")
    retain = _seconds(raw, "retain_s", where)
    back = _seconds(raw, "return_s", where)
    done = raw.get("done", False)
    if not isinstance(done, bool):
        raise HintError(f"{where}.done must be true or false, got {done!r}", f"{where}.done")
    if done and (retain or back is not None):
        raise HintError(f"{where}.done: a finished session has no retain_s or return_s", f"{where}.done")
    if retain is None:
        retain = DEFAULT_RETAIN_S if back is not None else 0.0
    if back is not None and back > retain:
        raise HintError(f"{where}.return_s ({back:g}) must be at most retain_s ({retain:g}): "
                        "a session expected back after its chunks may go is not retained", f"{where}.return_s")
    tenant = raw.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not _TENANT.fullmatch(tenant)):
        raise HintError(f"{where}.tenant must be 0-64 printable ASCII characters, got {tenant!r}", f"{where}.tenant")
    return SessionHint(session, retain, back, done, tenant)
