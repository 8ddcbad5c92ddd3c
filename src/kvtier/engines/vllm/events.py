"""vLLM KV events for what kvtier can load: what a KV-aware router sees of kvtier's tiers.

With ``--kv-events-config '{"enable_kv_cache_events": true, ...}'`` vLLM publishes, after each
engine step, the events its connector's ``take_events`` returns next to its own GPU events. This
module makes them:

- ``BlockStored`` when a chunk becomes loadable from kvtier, with ``medium`` the fastest tier
  holding it: ``"CPU"`` (the daemon's DRAM) or ``"STORAGE"`` (its SSD; a remote tier is
  ``"STORAGE"`` with ``locality="REMOTE"``), ``ownership="kvtier"``;
- ``BlockRemoved`` (same medium) when it stops being loadable from that tier: evicted, moved
  down a tier (then a ``BlockStored`` for the lower one follows), the daemon unreachable or
  restarted without it, the engine's cache reset (``reset_cache``), or the chunk no longer
  followed here (the oldest past ``events_max_chunks``).

The block hashes are vLLM's own (``request.block_hashes``, published as vLLM publishes its GPU
blocks'): a router matches a kvtier block to a GPU block of the same tokens with no knowledge of
kvtier's keys. A kvtier chunk of ``chunk_tokens`` covers several vLLM blocks; one event lists
them all. Blocks several of kvtier's chunks cover (a turn's partial chunk, then the full chunk
of the next turn) are counted per (block, medium): announced once, removed when the last goes.

What is loadable is read from the daemon (``probe``: counts and touches nothing) every
``poll_s`` on a thread of its own, for the chunks this engine saved or loaded while their
request was alive (the hashes and tokens are known only then). So an event lags the truth by up
to ``poll_s`` plus the time to vLLM's next step (vLLM publishes only after a step): a router
may route to a chunk just evicted, which is then a miss, never wrong data. A daemon restart is
seen by the next poll: what DRAM held is removed, what SSD kept is announced again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey

log = logging.getLogger(__name__)

DEFAULT_MAX_CHUNKS = 16384
"""Chunks followed at most per engine; the oldest past it is removed (announced as such)."""
DEFAULT_POLL_S = 0.5
PROBE_BATCH = 4096
"""Keys per probe call (one daemon lock hold each)."""

_LOCAL = {"host": "CPU", "disk": "STORAGE"}


def medium_of(tier: str | None) -> tuple[str, str] | None:
    """(medium, locality) of a daemon tier name; None for not held."""
    if tier is None:
        return None
    if tier in _LOCAL:
        return _LOCAL[tier], "LOCAL"
    return "STORAGE", "REMOTE"  # a shared tier across machines (valkey, mooncake)


@dataclass(frozen=True)
class Blocks:
    """What vLLM knows of a chunk's blocks, taken while its request was alive."""

    hashes: tuple[object, ...]
    """vLLM's block hashes, as published (an int of the low 64 bits, or bytes)."""
    parent: object | None
    tokens: tuple[int, ...]
    block_size: int
    lora_name: str | None = None


def request_blocks(request, first_block: int, nblocks: int, block_size: int,  # type: ignore[no-untyped-def]
                   hash_block_size: int) -> Blocks | None:
    """vLLM's hashes of blocks ``first_block .. first_block + nblocks`` of ``request`` (None
    when vLLM has not hashed them all)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

    raw = getattr(request, "block_hashes", None)
    if raw is None or nblocks <= 0:
        return None
    hashes = resolve_block_hashes(raw, hash_block_size, block_size)
    end = first_block + nblocks
    if len(hashes) < end:
        return None
    got = tuple(maybe_convert_block_hash(hashes[i]) for i in range(first_block, end))
    parent = maybe_convert_block_hash(hashes[first_block - 1]) if first_block else None
    tokens = tuple(int(t) for t in list(request.all_token_ids)[first_block * block_size : end * block_size])
    lora = getattr(request, "lora_request", None)
    return Blocks(got, parent, tokens, block_size, getattr(lora, "lora_name", None) if lora else None)


class KVEvents:
    """The events of one engine's scheduler; ``remember`` on the engine thread, ``poll`` on
    the poller's, ``take`` on the engine thread after each step."""

    def __init__(self, probe: Callable[[Sequence[ChunkKey]], list[str | None]],
                 max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        self._probe = probe
        self.max_chunks = max_chunks
        self._lock = threading.Lock()
        self._chunks: OrderedDict[ChunkKey, Blocks] = OrderedDict()
        self._where: dict[ChunkKey, tuple[str, str]] = {}
        """The (medium, locality) each chunk was last announced in."""
        self._count: dict[tuple[object, str, str], int] = {}
        """(block hash, medium, locality) -> chunks announced there covering the block."""
        self._out: deque[object] = deque()
        self.published = 0

    def remember(self, key: ChunkKey, blocks: Blocks | None) -> None:
        """Follow ``key``: announced once the daemon holds it."""
        if blocks is None:
            return
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)
                return
            self._chunks[key] = blocks
            while len(self._chunks) > self.max_chunks:
                old, was = self._chunks.popitem(last=False)
                self._move(old, was, None)

    def poll(self) -> None:
        """Read where each followed chunk is now and queue the events of what changed."""
        with self._lock:
            keys = list(self._chunks)
        tiers: list[str | None] = []
        for i in range(0, len(keys), PROBE_BATCH):
            tiers += self._probe(keys[i : i + PROBE_BATCH])
        with self._lock:
            for key, tier in zip(keys, tiers, strict=True):
                blocks = self._chunks.get(key)
                if blocks is not None:  # (not forgotten meanwhile)
                    self._move(key, blocks, medium_of(tier))

    def clear(self) -> None:
        """Stop following every chunk: each announced one is removed (a cache reset)."""
        with self._lock:
            for key, blocks in list(self._chunks.items()):
                self._move(key, blocks, None)
            self._chunks.clear()

    def take(self) -> list[object]:
        out = []
        while self._out:
            out.append(self._out.popleft())
        self.published += len(out)
        return out

    # -- under the lock ------------------------------------------------------------------------
    def _move(self, key: ChunkKey, blocks: Blocks, now: tuple[str, str] | None) -> None:
        was = self._where.get(key)
        if was == now:
            return
        if was is not None:
            self._emit_removed(blocks, was)
            del self._where[key]
        if now is not None:
            self._emit_stored(blocks, now)
            self._where[key] = now

    def _emit_stored(self, blocks: Blocks, where: tuple[str, str]) -> None:
        from vllm.distributed.kv_events import BlockStored

        new = []
        for i, h in enumerate(blocks.hashes):
            n = self._count.get((h, *where), 0)
            self._count[(h, *where)] = n + 1
            if not n:
                new.append(i)
        for lo, hi in _runs(new):  # (blocks another chunk announced already are not repeated)
            bs = blocks.block_size
            self._out.append(BlockStored(
                block_hashes=list(blocks.hashes[lo:hi]),
                parent_block_hash=blocks.hashes[lo - 1] if lo else blocks.parent,
                token_ids=list(blocks.tokens[lo * bs : hi * bs]), block_size=bs, lora_id=None,
                medium=where[0], lora_name=blocks.lora_name, group_idx=0, locality=where[1],
                ownership="kvtier"))

    def _emit_removed(self, blocks: Blocks, where: tuple[str, str]) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        gone = []
        for h in blocks.hashes:
            n = self._count.get((h, *where), 0) - 1
            if n > 0:
                self._count[(h, *where)] = n
            else:
                self._count.pop((h, *where), None)
                gone.append(h)
        if gone:
            self._out.append(BlockRemoved(block_hashes=gone, medium=where[0], group_idx=0,
                                          locality=where[1], ownership="kvtier"))


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs of sorted ``indices`` as [lo, hi) pairs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class Poller:
    """Calls ``events.poll`` every ``poll_s`` on a daemon thread until closed."""

    def __init__(self, events: KVEvents, poll_s: float) -> None:
        self._events = events
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self._events.poll()
            except Exception:
                log.exception("kvtier: KV events poll failed")

    def close(self) -> None:
        self._stop.set()


__all__ = ["Blocks", "KVEvents", "Poller", "medium_of", "request_blocks"]
