"""Context overflow: dropping the oldest turns, and re-using the kept turns' cached KV after it.

**Policy** (:func:`truncate`). A chat is its leading system messages and turns (a turn starts at
a user message and runs to the next one). When its prompt and the room kept for the reply exceed
the context window, whole turns are dropped, oldest first, until it fits; the system messages
and the last turn are never dropped, and if they alone do not fit, ``ValueError``.

**Re-use after truncation** (:func:`plan_shift`, :class:`ShiftedLoader`; AttentionStore, ATC'24).
A truncated prompt shares no chunk key past the system prompt with anything cached (keys are
chained hashes of the tokens before them), but the KV of its kept turns was saved by the previous
turn, under the keys of the sequence as it was then (untruncated, or truncated less). Every kept
token sits ``delta`` positions earlier now (``delta`` = tokens dropped), so its cached key is
rotated by ``-delta`` (:mod:`kvtier.engines.rope`) and its value used as is; the system prompt's
KV stays where it is. Only what that does not cover is prefilled.

This is an approximation, opt-in: the kept tokens' KV was computed while the dropped turns were
in context, so the model's output differs slightly from a recompute of the truncated prompt (the
TTFT benchmark measures by how much). The engine saves the truncated sequence's KV under its own
keys afterwards, so the next turn hits it directly, and so the approximation lives on in those
chunks (as it would in any server that keeps the KV of a sequence it served this way).

Token boundaries are checked, not assumed: the template renders the system messages alone, and
the truncated prompt's ids must be exactly those followed by the source sequence's ids after the
dropped ones. A template that renders a message differently by position fails the check, and the
engine recomputes (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.engines.layerwise import LayerwiseLoader
from kvtier.engines.rope import RotaryShift
from kvtier.store import KVStore, LookupResult

log = logging.getLogger(__name__)

Message = dict[str, str]
Render = Callable[[Sequence[Message]], list[int]]
"""Token ids of messages rendered by the chat template."""

MAX_SOURCES = 4
"""Earlier truncation levels tried as the source of re-usable KV (besides the untruncated chat):
the previous turn was usually truncated by at most a few turns fewer than this one."""


@dataclass(frozen=True, slots=True)
class Truncation:
    """A chat cut to fit the context window."""

    system: tuple[Message, ...]
    turns: Turns
    dropped_turns: int
    """Oldest turns left out (0: the chat fits whole)."""
    ids: list[int]
    """The prompt of what is kept."""
    dropped_tokens: int
    """Prompt tokens of the whole chat minus those of what is kept."""

    def messages(self, dropped: int | None = None) -> list[Message]:
        """The chat without its oldest ``dropped`` turns (default: as truncated)."""
        k = self.dropped_turns if dropped is None else dropped
        return list(self.system) + [m for turn in self.turns[k:] for m in turn]


Turns = tuple[tuple[Message, ...], ...]


def split_turns(messages: Sequence[Message]) -> tuple[tuple[Message, ...], Turns]:
    """The leading system messages, and the rest cut before each user message."""
    i = 0
    while i < len(messages) and messages[i].get("role") == "system":
        i += 1
    turns: list[list[Message]] = []
    for message in messages[i:]:
        if not turns or message.get("role") == "user":
            turns.append([])
        turns[-1].append(message)
    return tuple(messages[:i]), tuple(tuple(t) for t in turns)


def truncate(messages: Sequence[Message], render: Render, window: int, headroom: int) -> Truncation:
    """Drop the fewest oldest turns so that the prompt plus ``headroom`` fits ``window``.

    Renders the chat once when it fits, else O(log turns) times (prompt length falls as turns
    are dropped). Raises ValueError if the system messages and the last turn do not fit."""
    system, turns = split_turns(messages)
    full = render(messages)
    if len(full) + headroom <= window:
        return Truncation(system, turns, 0, full, 0)

    def fitting(k: int) -> list[int] | None:
        ids = render(list(system) + [m for turn in turns[k:] for m in turn])
        return ids if len(ids) + headroom <= window else None

    last = len(turns) - 1
    best = fitting(last) if last > 0 else None
    if best is None:
        need = len(render(list(system) + list(turns[-1]))) if turns else len(full)
        raise ValueError(
            f"the system prompt and the last turn take {need} tokens; with {headroom} tokens kept "
            f"for the reply they do not fit the context window of {window} tokens"
        )
    lo, hi = 1, last  # the least k that fits is in [lo, hi]; hi fits
    while lo < hi:
        mid = (lo + hi) // 2
        ids = fitting(mid)
        if ids is None:
            lo = mid + 1
        else:
            hi, best = mid, ids  # best is always the prompt for hi
    return Truncation(system, turns, hi, best, len(full) - len(best))


# -- re-use after truncation --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ShiftSpan:
    """How a truncated prompt maps onto a longer source sequence: its first ``head`` tokens are
    the source's, in place; the rest are the source's from ``head + delta`` on."""

    head: int
    delta: int


def align(source: Sequence[int], target: Sequence[int], head: Sequence[int]) -> ShiftSpan | None:
    """The span if ``target == head + source[len(head) + delta:]`` with ``source`` starting with
    ``head`` and ``delta = len(source) - len(target) > 0``; None if the ids do not line up."""
    h, delta = len(head), len(source) - len(target)
    if delta <= 0 or list(source[:h]) != list(head) or list(target[:h]) != list(head):
        return None
    if list(source[h + delta :]) != list(target[h:]):
        return None
    return ShiftSpan(h, delta)


@dataclass(frozen=True, slots=True)
class ShiftPlan:
    """Cached KV of a source sequence that covers the first ``tokens`` tokens of a truncated
    prompt once moved."""

    hit: LookupResult
    """The source's cached prefix."""
    span: ShiftSpan
    tokens: int
    source_dropped: int
    """Turns the source itself had dropped (0: the untruncated chat)."""


def plan_shift(
    store: KVStore, render: Render, render_head: Render, cut: Truncation
) -> ShiftPlan | None:
    """Find cached KV for ``cut``'s prompt among the chat's less truncated versions: the
    untruncated chat and the ``MAX_SOURCES`` levels just below ``cut``'s. ``render_head``
    renders the system messages alone, without a generation prompt. None (logged why) if none
    has any kept token cached. Looks up (counted in the store's stats); loads nothing."""
    try:
        head = render_head(cut.system)
    except Exception as exc:  # noqa: BLE001 - a template may refuse a chat without a user message
        log.info("truncated prompt: recomputing, the template cannot render the system prompt "
                 "alone (%s)", exc)
        return None
    k = cut.dropped_turns
    levels = list(range(k - 1, max(-1, k - 1 - MAX_SOURCES), -1))
    if 0 not in levels:
        levels.append(0)
    target = cut.ids
    misaligned = 0
    for j in levels:
        source = render(cut.messages(j))
        span = align(source, target, head)
        if span is None:
            misaligned += 1
            continue
        hit = store.lookup(source[:-1])
        kept = min(hit.hit_tokens - span.head - span.delta, len(target) - 1 - span.head)
        if kept > 0:
            return ShiftPlan(hit, span, span.head + kept, j)
    if misaligned == len(levels):
        log.info("truncated prompt: its tokens are not the system prompt's followed by the kept "
                 "turns' as rendered before (template renders by position?); recomputing")
    else:
        log.info("truncated prompt: no kept turn's KV is cached; recomputing")
    return None


class ShiftedLoader:
    """The engine's layer source for a :class:`ShiftPlan`: loads only the source chunks that
    hold the head and the kept tokens (layer by layer, :class:`LayerwiseLoader`), and hands each
    layer over as ``[1, heads, tokens, head_dim]`` K and V with the kept keys rotated by
    ``-delta``. The rotation runs in :meth:`wait`, on the forward pass's thread: about 1 ms a
    layer for 1,300 tokens on a CPU core, less than a second thread of tensor work competing
    with the forward pass's own threads costs. :meth:`wait` raises
    :class:`~kvtier.engines.layerwise.LoadFailed` if a layer could not be read in full."""

    def __init__(
        self, store: KVStore, plan: ShiftPlan, shift: RotaryShift, device: torch.device | str
    ) -> None:
        c = store.layout.chunk_tokens
        head, delta = plan.span.head, plan.span.delta
        self.tokens = plan.tokens
        self.shifted_tokens = plan.tokens - head
        self.delta = delta
        self._head = head
        self._shift = shift
        start, end = head + delta, head + delta + self.shifted_tokens  # source positions kept
        chunks = sorted(set(range(-(-head // c))) | set(range(start // c, -(-end // c))))
        self._kept_at = chunks.index(start // c) * c + start % c  # in the loaded buffer
        sub = LookupResult(
            num_tokens=len(chunks) * c, hit_tokens=len(chunks) * c,
            keys=[plan.hit.keys[i] for i in chunks], tiers=[plan.hit.tiers[i] for i in chunks],
        )
        self.tier_tokens: dict[str, int] = {}
        for i in chunks:  # reused tokens per tier they are read from
            lo, hi = i * c, (i + 1) * c
            n = max(0, min(hi, head) - lo) + max(0, min(hi, end) - max(lo, start))
            name = plan.hit.tiers[i]
            self.tier_tokens[name] = self.tier_tokens.get(name, 0) + n
        self._loader = LayerwiseLoader(store, sub, device)

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until ``layer`` is loaded; its (K, V), the kept keys moved into place."""
        keys, values = self._loader.wait(layer)
        h, at, n = self._head, self._kept_at, self.shifted_tokens
        moved = self._shift.shift_keys(keys[:, :, at : at + n], -self.delta)
        return (torch.cat((keys[:, :, :h], moved), dim=2),
                torch.cat((values[:, :, :h], values[:, :, at : at + n]), dim=2))

    def join(self) -> None:
        self._loader.join()

    @property
    def load_s(self) -> float:
        return self._loader.load_s

    @property
    def wait_s(self) -> float:
        return self._loader.wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self._loader.wait_s = value

    @property
    def hidden_fraction(self) -> float:
        return self._loader.hidden_fraction
