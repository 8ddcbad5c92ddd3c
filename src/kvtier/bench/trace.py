"""Request traces in Mooncake's format (FAST'25 release): one JSON object a line.

``timestamp``: arrival in ms; ``input_length`` and ``output_length``: tokens; ``hash_ids``:
ids of the prompt's 512-token blocks, prefix-chained (two prompts share block ``i``'s id only if
they share every token up to the end of that block; the last, partial block gets an id too).
Sessions are not needed; kvtier's own traces name each request's session in an optional
``session_id`` (an integer or a string), which the parser keeps when present.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.errors import KVTierError

MOONCAKE_BLOCK_TOKENS = 512
MAX_LENGTH = 1 << 31
"""Tokens of a request's input or output at most (a larger one is a malformed line)."""
MAX_TIMESTAMP_MS = 1e15
"""Arrival at most (ms; about 31,700 years): a larger or non-finite one is a malformed line."""


class TraceError(KVTierError, ValueError):
    """A malformed trace; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    input_length: int
    output_length: int
    keys: list[ChunkKey]
    """One key per block id, in prefix order."""
    session_id: int | str | None = None
    """The line's ``session_id``, when it has one."""
    think_s: float | None = None
    """Seconds between the previous turn's reply and this turn, for a closed-loop replay (not in
    the file: :func:`kvtier.bench.paper.retime` sets it)."""


@dataclass(frozen=True)
class Trace:
    requests: list[Request]
    """In service order: by arrival, ties in file order."""
    unique_blocks: int
    name: str = ""
    _future: dict[ChunkKey, list[int]] = field(default_factory=dict, repr=False, compare=False)

    def future(self) -> dict[ChunkKey, list[int]]:
        """For each key, the ascending numbers of the requests that use it (built once)."""
        if not self._future:
            for seq, req in enumerate(self.requests):
                for key in dict.fromkeys(req.keys):
                    self._future.setdefault(key, []).append(seq)
        return self._future

    @property
    def total_blocks(self) -> int:
        return sum(len(r.keys) for r in self.requests)


def _shown(value: object) -> str:
    """``value`` for an error message (a huge integer by its number of digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _field_int(obj: dict[str, object], name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LENGTH:
        raise TraceError(f"{where}: {name!r} must be an integer of tokens in [0, {MAX_LENGTH}], "
                         f"got {_shown(value)}")
    return value


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number a trace may hold")


def parse_trace(lines: Iterable[str], name: str = "<trace>") -> Trace:
    """Parse Mooncake JSONL. Blank lines are skipped; anything else malformed raises
    :class:`TraceError` naming ``name`` and the line number."""
    interned: dict[int, ChunkKey] = {}
    rows: list[Request] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}, line {lineno}"
        try:
            obj = json.loads(line, parse_constant=_no_constant)  # NaN, Infinity, -Infinity
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise TraceError(f"{where}: JSON nested too deeply") from None
        except ValueError as exc:  # a constant refused, an integer of too many digits
            raise TraceError(f"{where}: not a valid trace line ({exc})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        stamp = obj.get("timestamp")
        if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) \
                or not (0 <= stamp <= MAX_TIMESTAMP_MS and math.isfinite(stamp)):
            raise TraceError(f"{where}: 'timestamp' must be a finite number of ms in [0, {MAX_TIMESTAMP_MS:g}], "
                             f"got {_shown(stamp)}")
        input_length = _field_int(obj, "input_length", where)
        output_length = _field_int(obj, "output_length", where)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers, got {ids!r}")
        keys: list[ChunkKey] = []
        for h in ids:
            key = interned.get(h) if isinstance(h, int) and not isinstance(h, bool) else None
            if key is None:
                if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < 1 << (8 * KEY_BYTES):
                    raise TraceError(f"{where}: hash id {_shown(h)} is not a non-negative integer of {8 * KEY_BYTES} bits")
                key = interned[h] = ChunkKey(h.to_bytes(KEY_BYTES, "little"))
            keys.append(key)
        if len(keys) * MOONCAKE_BLOCK_TOKENS < input_length or (
            keys and (len(keys) - 1) * MOONCAKE_BLOCK_TOKENS >= input_length
        ):
            raise TraceError(
                f"{where}: {len(keys)} hash ids do not cover input_length {input_length} "
                f"in blocks of {MOONCAKE_BLOCK_TOKENS} tokens"
            )
        session = obj.get("session_id")
        if session is not None and (isinstance(session, bool) or not isinstance(session, (int, str))):
            raise TraceError(f"{where}: 'session_id' must be an integer or a string, got {session!r}")
        rows.append(Request(stamp / 1000.0, input_length, output_length, keys, session))
    if not rows:
        raise TraceError(f"{name}: no requests")
    rows.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return Trace(requests=rows, unique_blocks=len(interned), name=name)


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            return parse_trace(f, name=str(path))
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None


def write_request(out: TextIO, timestamp_ms: int, input_length: int, output_length: int,
                  hash_ids: Sequence[int], session_id: int | str | None = None) -> None:
    """One line of a trace; ``session_id`` is written only when given."""
    row: dict[str, object] = {"timestamp": timestamp_ms, "input_length": input_length,
                              "output_length": output_length, "hash_ids": list(hash_ids)}
    if session_id is not None:
        row["session_id"] = session_id
    out.write(json.dumps(row) + "\n")


class BlockIds:
    """Mooncake-style block ids for prompts that grow turn by turn (multi-turn sessions).

    A session keeps the ids of its full blocks in a list; :meth:`prompt` extends that list with
    fresh ids as its history grows past block boundaries, so a later turn shares every full
    block of an earlier one. The last, partial block of a prompt always gets a fresh id: its
    content changes as the history grows, so it can never be reused. Ids count up from 0 in the
    order they are issued.
    """

    def __init__(self) -> None:
        self.issued = 0
        """Ids handed out so far (every one of them names a distinct block)."""

    def fresh(self, n: int) -> list[int]:
        """``n`` new ids (the full blocks of a prompt shared from the start, say)."""
        ids = list(range(self.issued, self.issued + n))
        self.issued += n
        return ids

    def prompt(self, full: list[int], tokens: int) -> list[int]:
        """The hash ids of a ``tokens``-token prompt whose full blocks begin with ``full`` (the
        session's, extended in place with fresh ids up to ``tokens // 512``)."""
        c = MOONCAKE_BLOCK_TOKENS
        if len(full) < tokens // c:
            full.extend(self.fresh(tokens // c - len(full)))
        return full[: tokens // c] + (self.fresh(1) if tokens % c else [])
