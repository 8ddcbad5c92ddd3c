"""The client processes of the daemon load test (:mod:`kvtier.bench.daemon_load`): deterministic
conversations any process can check byte for byte, and the worker, storm and probe loops.

Every process reports through a shared array of counters, one row per process (row
``STORM_ROW`` for the storm, row ``instance`` for each worker).
"""

from __future__ import annotations

import array
import math
import random
import signal
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

MODEL = "kvtier-bench-daemon@1"
VOCAB = 32000
CONV_STRIDE = 1 << 20
"""Conversation ids of worker instance ``i`` are ``i * CONV_STRIDE + k``."""
PROBE_CONVERSATION = 1 << 40
STORM_ROW = 0
"""Row of the counters the storm writes; workers' instances start at 1."""
COUNTERS = ("ready", "steps", "lookups", "hit_tokens", "loads", "verified_tokens", "wrong_tokens", "short_loads",
            "saves", "stored_chunks", "present_chunks", "busy_chunks", "dropped_chunks", "revisits",
            "prefetches", "conversations", "errors", "lost_leases")
_C = {name: i for i, name in enumerate(COUNTERS)}

if TYPE_CHECKING:
    from kvtier.bench.daemon_config import DaemonBenchConfig


# -- deterministic content ------------------------------------------------------------------------
class Conversations:
    """Token ids and KV of every conversation, as functions of the seed and its id only."""

    def __init__(self, config: DaemonBenchConfig, cache: int = 32) -> None:
        self.config = config
        self.layout = config.layout
        self._cache: OrderedDict[int, tuple[list[int], torch.Tensor]] = OrderedDict()
        self._size = cache
        rng = np.random.default_rng([config.seed, 0])
        self._system_ids = rng.integers(0, VOCAB, config.system_tokens).tolist()
        self._system_kv = self._randn(torch.Generator().manual_seed(_seed(config.seed, 0)),
                                      config.system_tokens)

    def _randn(self, gen: torch.Generator, tokens: int) -> torch.Tensor:
        lay = self.layout
        return torch.randn((lay.num_layers, lay.kv, lay.num_kv_heads, tokens, lay.head_dim), generator=gen)

    def get(self, conv: int) -> tuple[list[int], torch.Tensor]:
        """Token ids (``max_tokens``) and KV ``[layers, kv, heads, max_tokens, head_dim]``."""
        got = self._cache.get(conv)
        if got is not None:
            self._cache.move_to_end(conv)
            return got
        cfg = self.config
        own = cfg.max_tokens - cfg.system_tokens
        ids = self._system_ids + np.random.default_rng([cfg.seed, 1, conv]).integers(0, VOCAB, own).tolist()
        kv = torch.cat([self._system_kv,
                        self._randn(torch.Generator().manual_seed(_seed(cfg.seed, conv + 1)), own)], dim=3)
        got = self._cache[conv] = (ids, kv)
        while len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return got


def _seed(seed: int, n: int) -> int:
    return int(np.random.SeedSequence([seed, n]).generate_state(1, np.uint64)[0] >> 1)


def wrong_tokens(buf: torch.Tensor, kv: torch.Tensor, n: int) -> int:
    """Tokens among the first ``n`` of ``buf`` whose KV differs anywhere from ``kv``'s."""
    got, want = buf[:, :, :, :n], kv[:, :, :, :n]
    if torch.equal(got, want):
        return 0
    differs = (got != want).permute(3, 0, 1, 2, 4).reshape(n, -1).any(dim=1)
    return int(differs.sum())


class _Row:
    """One process's counters in the shared array (written by that process only)."""

    def __init__(self, counters: object, row: int) -> None:
        self._a = counters
        self._base = row * len(COUNTERS)

    def add(self, name: str, n: int = 1) -> None:
        self._a[self._base + _C[name]] += n  # type: ignore[index]

    def set(self, name: str, n: int) -> None:
        self._a[self._base + _C[name]] = n  # type: ignore[index]

    def get(self, name: str) -> int:
        return int(self._a[self._base + _C[name]])  # type: ignore[index]


def _created(counters: object, instances: int) -> list[tuple[int, int]]:
    """(instance, conversations it created) of every worker instance that created some."""
    out = []
    for inst in range(1, instances + 1):
        n = _Row(counters, inst).get("conversations")
        if n:
            out.append((inst, n))
    return out


def _pick_old(rng: random.Random, created: list[tuple[int, int]], skip_newest: int = 0) -> int | None:
    """A conversation id drawn uniformly from those created (less each instance's newest few)."""
    pool = [(inst, n - skip_newest) for inst, n in created if n > skip_newest]
    total = sum(n for _, n in pool)
    if not total:
        return None
    r = rng.randrange(total)
    for inst, n in pool:
        if r < n:
            return inst * CONV_STRIDE + r
        r -= n
    raise AssertionError("unreachable")  # pragma: no cover


def _client(config: DaemonBenchConfig, socket_path: str):  # type: ignore[no-untyped-def]
    from kvtier.server.client import StoreClient

    return StoreClient(socket_path, model=MODEL, layout=config.layout, timeout_s=5.0, retry_s=0.2)


def _buffers(config: DaemonBenchConfig) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    lay = config.layout
    buf = torch.empty((lay.num_layers, lay.kv, lay.num_kv_heads, config.max_tokens, lay.head_dim))
    return buf, [(buf[layer, 0], buf[layer, 1]) for layer in range(lay.num_layers)]


def _check(client, convs: Conversations, conv: int, tokens: list[int],  # type: ignore[no-untyped-def]
           buf: torch.Tensor, out: list) -> tuple[int, int, int, bool]:
    """Lookup ``tokens``, load the hit, verify it: (hit tokens, loaded tokens, wrong tokens, short)."""
    hit = client.lookup(tokens)
    if not hit.hit_tokens:
        return 0, 0, 0, False
    buf.fill_(math.nan)
    loaded = client.load(hit, out).tokens
    _, kv = convs.get(conv)
    bad = wrong_tokens(buf, kv, loaded) if loaded else 0
    return hit.hit_tokens, loaded, bad, loaded < hit.hit_tokens


# -- the processes --------------------------------------------------------------------------------
def _worker(config: DaemonBenchConfig, socket_path: str, instance: int, counters: object,
            stop: object) -> None:
    """A worker instance's loop (a process of its own) until ``stop`` is set."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it
    torch.set_num_threads(1)
    row = _Row(counters, instance)
    rng = random.Random(_seed(config.seed, 1000 + instance))
    convs = Conversations(config)
    client = _client(config, socket_path)
    buf, out = _buffers(config)
    active: list[list[int]] = []  # [conversation, tokens saved]
    made = 0
    think = config.think_ms / 1e3
    row.set("ready", 1)
    try:
        while not stop.value:  # type: ignore[attr-defined]
            created = _created(counters, config.max_instances)
            if created and rng.random() < config.revisit:
                conv = _pick_old(rng, created)
                assert conv is not None
                ids, _ = convs.get(conv)
                hit, loaded, bad, short = _check(client, convs, conv, ids, buf, out)
                row.add("revisits")
            else:
                if len(active) < config.active:
                    active.append([instance * CONV_STRIDE + made, 0])
                    made += 1
                    row.set("conversations", made)
                turn = rng.choice(active)
                conv, length = turn
                grow = rng.randint(config.turn_tokens // 2, config.turn_tokens * 3 // 2)
                length = min(config.max_tokens, max(length + grow, config.system_tokens + 1))
                ids, kv = convs.get(conv)
                tokens = ids[:length]
                hit, loaded, bad, short = _check(client, convs, conv, tokens, buf, out)
                res = client.save(tokens, [(kv[layer, 0, :, :length], kv[layer, 1, :, :length])
                                           for layer in range(config.num_layers)])
                row.add("saves")
                row.add("stored_chunks", res.stored)
                row.add("present_chunks", res.present)
                row.add("busy_chunks", res.busy)
                row.add("dropped_chunks", res.dropped)
                turn[1] = length
                if length >= config.max_tokens:
                    active.remove(turn)
            row.add("steps")
            row.add("lookups")
            row.add("hit_tokens", hit)
            if loaded:
                row.add("loads")
                row.add("verified_tokens", loaded)
                row.add("wrong_tokens", bad)
                row.add("short_loads", int(short))
            row.set("errors", client.errors)
            row.set("lost_leases", client.lost_leases)
            if think:
                time.sleep(think)
    finally:
        client.close()


def _storm(config: DaemonBenchConfig, socket_path: str, counters: object, stop: object) -> None:
    """Prefetch old conversations (``wait=False``) until ``stop`` is set."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    row = _Row(counters, STORM_ROW)
    rng = random.Random(_seed(config.seed, 999))
    convs = Conversations(config, cache=4)
    client = _client(config, socket_path)
    keys: OrderedDict[int, list] = OrderedDict()
    interval = 1.0 / config.storm_rate if config.storm_rate else 0.0
    next_at = time.perf_counter()
    row.set("ready", 1)
    try:
        while not stop.value:  # type: ignore[attr-defined]
            conv = _pick_old(rng, _created(counters, config.max_instances), skip_newest=config.active)
            if conv is None:
                time.sleep(0.01)
                continue
            ks = keys.get(conv)
            if ks is None:
                ks = keys[conv] = client.keys_for(convs.get(conv)[0])
                while len(keys) > 4096:
                    keys.popitem(last=False)
            client.prefetch(ks, wait=False)
            row.add("prefetches")
            row.set("errors", client.errors)
            if interval:
                next_at = max(next_at + interval, time.perf_counter())
                time.sleep(max(0.0, next_at - time.perf_counter()))
    finally:
        client.close()


def _probe(config: DaemonBenchConfig, socket_path: str, conn) -> None:  # type: ignore[no-untyped-def]
    """Save the probe's conversation, then on each ``("measure", seconds)`` time lookups of it
    and send back the wall times (``array('d')`` bytes), its errors and short hits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    convs = Conversations(config, cache=1)
    client = _client(config, socket_path)
    try:
        ids, kv = convs.get(PROBE_CONVERSATION)
        n = config.probe_tokens
        tokens = ids[:n]
        client.save(tokens, [(kv[layer, 0, :, :n], kv[layer, 1, :, :n]) for layer in range(config.num_layers)])
        want = n - n % config.chunk_tokens
        conn.send(("ready", client.lookup(tokens).hit_tokens == want))
        interval = config.probe_interval_ms / 1e3
        while True:
            msg = conn.recv()
            if msg[0] != "measure":
                return
            times = array.array("d")
            errors0, short = client.errors, 0
            end = time.perf_counter() + msg[1]
            next_at = time.perf_counter()
            while (now := time.perf_counter()) < end:
                hit = client.lookup(tokens)
                times.append(time.perf_counter() - now)
                short += hit.hit_tokens < want
                next_at = max(next_at + interval, time.perf_counter())
                time.sleep(max(0.0, next_at - time.perf_counter()))
            conn.send_bytes(times.tobytes())
            conn.send((client.errors - errors0, short))
    finally:
        client.close()


