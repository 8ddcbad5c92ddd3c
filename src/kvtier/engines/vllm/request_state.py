"""The scheduler half's record of each request vLLM allocates blocks for (:class:`_Tracked`),
the request's phase in the scheduler half's state machine (:class:`Phase`, drawn in
:mod:`.scheduler`), and whether a request opted out of kvtier (:func:`skipped`)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from kvtier.core.keys import ChunkKey
from kvtier.core.session_hints import HintError, SessionHint, parse_hint

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHING = "finishing"


def skipped(request) -> bool:  # type: ignore[no-untyped-def]
    """A request may opt out: ``SamplingParams(extra_args={"kv_transfer_params":
    {"kvtier": "skip"}})`` -- no lookup, no save (a baseline run, a private prompt)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    if getattr(request, "prompt_embeds", None) is not None:
        return True  # its KV depends on embeddings, not on token ids a key could name
    return params.get("kvtier") == "skip"


def request_hint(request) -> SessionHint | HintError | None:  # type: ignore[no-untyped-def]
    """The session hint a request carries (``kv_transfer_params.kvtier``, see
    :mod:`kvtier.core.session_hints`): None without one, the :class:`HintError` of a malformed
    one (the request is served all the same, without it)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    raw = params.get("kvtier") if isinstance(params, dict) else None
    if raw is None or raw == "skip":
        return None
    try:
        return parse_hint(raw)
    except HintError as exc:
        return exc


@dataclass
class _Tracked:
    request: object  # vLLM's Request: its all_token_ids grow as it generates
    phase: Phase = Phase.WAITING
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0
    """Full chunks known stored in kvtier (hit, or planned for saving)."""
    keys: list[ChunkKey] = field(default_factory=list)
    """The keys of its full chunks, as far as computed."""
    epoch: bytes | None = None
    """The cache epoch it was admitted in: after a ``reset_cache`` nothing of it is saved (its
    KV may be of the weights before the reset)."""
