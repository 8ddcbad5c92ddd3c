"""vLLM KV events for what kvtier can load: what a KV-aware router sees of kvtier's tiers.

With ``--kv-events-config '{"enable_kv_cache_events": true, ...}'`` vLLM publishes, after each
engine step, the events its connector's ``take_events`` returns next to its own GPU events. This
module makes them:

- ``BlockStored`` when a chunk becomes loadable from kvtier, with ``medium`` the fastest tier
  holding it: ``"CPU"`` (the daemon's DRAM) or ``"STORAGE"`` (its SSD; a remote tier is
  ``"STORAGE"`` with ``locality="REMOTE"``), ``ownership="kvtier"``;
- ``BlockRemoved`` (same medium) when it stops being loadable from that tier: evicted, moved
  down a tier (then a ``BlockStored`` for the lower one follows), a chunk before it no longer
  held (kvtier loads a run of chunks from the first), the daemon unreachable for two polls or
  restarted without it, the engine's cache reset (``reset_cache``), or the chunk no longer
  followed here (the oldest past ``events_max_chunks``).

The block hashes are vLLM's own (``request.block_hashes``, published as vLLM publishes its GPU
blocks', with the same ``extra_keys``, ``lora_id`` and ``lora_name``): a router matches a kvtier
block to a GPU block of the same tokens with no knowledge of kvtier's keys. A kvtier chunk of
``chunk_tokens`` covers several vLLM blocks; one event lists them all. Blocks several of
kvtier's chunks cover (a turn's partial chunk, then the full chunk of the next turn) are counted
per (block, medium, locality): announced once, removed when the last goes.

What is loadable is read from the daemon (``probe``: counts and touches nothing) every
``poll_s`` on a thread of its own, for the chunks this engine saved or loaded while their
request was alive (the hashes and tokens are known only then). The poll only records what is
held; the events are the difference between that and what was announced, made when vLLM takes
them after a step (an idle engine queues nothing). So an event lags the truth by up to
``poll_s`` plus the time to vLLM's next step: a router may route to a chunk just evicted, which
is then a miss, never wrong data.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.core.keys import ChunkKey
from kvtier.errors import DaemonUnavailable

log = logging.getLogger(__name__)

DEFAULT_MAX_CHUNKS = 4096
"""Chunks followed at most per engine (about a million tokens at 256 a chunk); the oldest past
it is removed (announced as such). A poll probes them all: about 2.5 ms of the poller's CPU
per 4096 chunks."""
DEFAULT_POLL_S = 0.5
PROBE_BATCH = 4096
"""Keys per probe call (one daemon lock hold each)."""
UNREACHABLE_POLLS = 2
"""Polls in a row the daemon must fail before nothing is loadable (one timeout is not a loss)."""

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
    """vLLM's hash of the block before the first (None: the first block of the sequence)."""
    tokens: array
    block_size: int
    after: ChunkKey | None = None
    """kvtier's key of the chunk before this one (None: the first chunk): kvtier loads a run of
    chunks from the first, so this one is loadable only while that one is."""
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list | None = None


def request_blocks(request, first_block: int, nblocks: int, block_size: int,  # type: ignore[no-untyped-def]
                   hash_block_size: int, after: ChunkKey | None) -> Blocks | None:
    """vLLM's hashes of blocks ``first_block .. first_block + nblocks`` of ``request``, and
    what else vLLM's own events carry for them (None when vLLM has not hashed them all, or its
    hashes are not of whole blocks)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

    raw = getattr(request, "block_hashes", None)
    if raw is None or nblocks <= 0 or block_size % hash_block_size:
        return None
    hashes = resolve_block_hashes(raw, hash_block_size, block_size)
    end = first_block + nblocks
    if len(hashes) < end:
        return None
    got = tuple(maybe_convert_block_hash(hashes[i]) for i in range(first_block, end))
    parent = maybe_convert_block_hash(hashes[first_block - 1]) if first_block else None
    lo, hi = first_block * block_size, end * block_size
    tokens = array("q", request.all_token_ids[lo:hi])
    lora = getattr(request, "lora_request", None)
    return Blocks(got, parent, tokens, block_size, after,
                  getattr(lora, "adapter_id", None) if lora else None,
                  getattr(lora, "name", getattr(lora, "lora_name", None)) if lora else None,
                  _extra_keys(request, lo, hi, block_size))


def _extra_keys(request, lo: int, hi: int, block_size: int) -> list | None:  # type: ignore[no-untyped-def]
    """The per-block ``extra_keys`` vLLM's own events carry for these blocks (salt, LoRA,
    images), or None (none, or this vLLM computes them otherwise)."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

        keys, mm = [], 0
        for start in range(0, hi, block_size):  # (the image index runs from the first block)
            extra, mm = generate_block_hash_extra_keys(request, start, start + block_size, mm)
            if start >= lo:
                keys.append(extra)
        return to_event_extra_keys(keys) if any(k is not None for k in keys) else None
    except Exception:  # noqa: BLE001 - an event without them is still right
        return None


class KVEvents:
    """The events of one engine's scheduler: ``remember`` and ``take`` on the engine thread,
    ``poll`` on the poller's."""

    def __init__(self, probe: Callable[[Sequence[ChunkKey]], list[str | None]],
                 max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        self._probe = probe
        """Where each key is held (None: not); raises DaemonUnavailable when it cannot tell."""
        self.max_chunks = max_chunks
        self._lock = threading.Lock()
        self._chunks: OrderedDict[ChunkKey, Blocks] = OrderedDict()
        self._held: dict[ChunkKey, tuple[str, str]] = {}
        """Where the last poll found each followed, loadable chunk."""
        self._where: dict[ChunkKey, tuple[str, str]] = {}
        """Where each chunk was announced."""
        self._changed: set[ChunkKey] = set()
        self._dropped: dict[ChunkKey, Blocks] = {}
        """Chunks no longer followed whose announcement is still to be taken back."""
        self._count: dict[tuple[object, str, str], int] = {}
        """(block hash, medium, locality) -> announced chunks covering the block there."""
        self._failed_polls = 0
        self.published = 0

    def follows(self, key: ChunkKey) -> bool:
        """Whether ``key`` is followed (it is then the newest)."""
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)
                return True
            return False

    def remember(self, key: ChunkKey, blocks: Blocks | None) -> None:
        """Follow ``key``: announced once the daemon holds it and the chunks before it."""
        if blocks is None:
            return
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)
                return
            self._chunks[key] = blocks
            self._dropped.pop(key, None)
            while len(self._chunks) > self.max_chunks:
                old, was = self._chunks.popitem(last=False)
                self._forget(old, was)

    def poll(self) -> None:
        """Read where each followed chunk is held now (the events are made at :meth:`take`)."""
        with self._lock:
            keys = list(self._chunks)
        tiers: list[str | None] = []
        try:
            for i in range(0, len(keys), PROBE_BATCH):
                tiers += self._probe(keys[i : i + PROBE_BATCH])
        except DaemonUnavailable:
            self._failed_polls += 1
            if self._failed_polls < UNREACHABLE_POLLS:
                return
            tiers = [None] * len(keys)  # unreachable: nothing is loadable
        else:
            self._failed_polls = 0
        with self._lock:
            held = {k: w for k, t in zip(keys, tiers, strict=True) if (w := medium_of(t)) is not None}
            ok: dict[ChunkKey, bool] = {}
            for key in keys:
                if key not in self._chunks:
                    continue  # (forgotten meanwhile)
                now = held.get(key) if self._loadable(key, held, ok) else None
                if self._held.get(key) != now:
                    if now is None:
                        self._held.pop(key, None)
                    else:
                        self._held[key] = now
                    self._changed.add(key)

    def _loadable(self, key: ChunkKey, held: dict[ChunkKey, tuple[str, str]], ok: dict[ChunkKey, bool]) -> bool:
        """Held, and so is every chunk before it (one before it not followed here: unknown, so
        not announced); ``ok`` remembers the answers of this poll."""
        path: list[ChunkKey] = []
        k: ChunkKey | None = key
        while True:
            if k is None:
                result = True
                break
            if k in ok:
                result = ok[k]
                break
            blocks = self._chunks.get(k)
            if k not in held or blocks is None or len(path) > len(self._chunks):
                result = False
                break
            path.append(k)
            k = blocks.after
        for p in path:
            ok[p] = result
        return result

    def clear(self) -> None:
        """Stop following every chunk: each announced one is removed (a cache reset)."""
        with self._lock:
            for key, blocks in list(self._chunks.items()):
                self._forget(key, blocks)
            self._chunks.clear()

    def take(self) -> list[object]:
        """The events of what changed since the last take."""
        out: list[object] = []
        with self._lock:
            for key, blocks in self._dropped.items():
                self._move(out, key, blocks, None)
            self._dropped.clear()
            for key in self._changed:
                blocks = self._chunks.get(key)
                if blocks is not None:
                    self._move(out, key, blocks, self._held.get(key))
            self._changed.clear()
        self.published += len(out)
        return out

    # -- under the lock ------------------------------------------------------------------------
    def _forget(self, key: ChunkKey, blocks: Blocks) -> None:
        self._held.pop(key, None)
        self._changed.discard(key)
        if key in self._where:
            self._dropped[key] = blocks

    def _move(self, out: list[object], key: ChunkKey, blocks: Blocks, now: tuple[str, str] | None) -> None:
        was = self._where.get(key)
        if was == now:
            return
        if was is not None:
            self._removed(out, blocks, was)
            del self._where[key]
        if now is not None:
            self._stored(out, blocks, now)
            self._where[key] = now

    def _stored(self, out: list[object], blocks: Blocks, where: tuple[str, str]) -> None:
        from vllm.distributed.kv_events import BlockStored

        new = []
        for i, h in enumerate(blocks.hashes):
            n = self._count.get((h, *where), 0)
            self._count[(h, *where)] = n + 1
            if not n:
                new.append(i)
        bs = blocks.block_size
        for lo, hi in _runs(new):  # (blocks another chunk announced already are not repeated)
            out.append(BlockStored(
                block_hashes=list(blocks.hashes[lo:hi]),
                parent_block_hash=blocks.hashes[lo - 1] if lo else blocks.parent,
                token_ids=blocks.tokens[lo * bs : hi * bs].tolist(), block_size=bs,
                lora_id=blocks.lora_id, medium=where[0], lora_name=blocks.lora_name,
                extra_keys=blocks.extra_keys[lo:hi] if blocks.extra_keys else None,
                group_idx=0, locality=where[1], ownership="kvtier"))

    def _removed(self, out: list[object], blocks: Blocks, where: tuple[str, str]) -> None:
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
            out.append(BlockRemoved(block_hashes=gone, medium=where[0], group_idx=0,
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
            except Exception:  # events must never take the scheduler down
                log.exception("kvtier: KV events poll failed")

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


__all__ = ["Blocks", "KVEvents", "Poller", "medium_of", "request_blocks"]
