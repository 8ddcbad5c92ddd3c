"""What runs on the worker thread of a Mooncake call for :mod:`kvtier.tiers.mooncake`: batched
put sessions fed by the caller's thread (:class:`Relay`), and batched reads straight into the
callers' buffers. Mooncake's error codes that the tier acts on live here too."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch
from mooncake.store import MooncakeDistributedStore

from kvtier.tiers.remote_buffers import BufferPool
from kvtier.tiers.remote_format import FIXED_BYTES

NO_AVAILABLE_HANDLE, INVALID_PARAMS = -200, -600
REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS = -703, -704, -705
HEAD_PEEK = 4096
"""Bytes read to learn an object's header (that of a 32-layer chunk takes 312 bytes)."""
ZERO_COPY_MIN = 64 << 10
"""Payloads from this size on are sent from the caller's memory, smaller ones copied."""


def start_sessions(store: MooncakeDistributedStore, names: list[str], sizes: list[int]) -> list[int]:
    """Open put sessions (Mooncake's PutStart), one code per name. A session this client left
    open after a failed attempt (the master was down when it tried to revoke) is revoked and
    its start retried."""
    rcs = store.batch_put_session_start(names, sizes)
    stale = [i for i, rc in enumerate(rcs) if rc == INVALID_PARAMS]
    if stale:
        again = [names[i] for i in stale]
        store.batch_put_session_revoke(again)
        for i, rc in zip(stale, store.batch_put_session_start(again, [sizes[i] for i in stale]), strict=True):
            rcs[i] = rc
    return rcs


class Relay:
    """Objects handed from the caller's thread, which checksums them, to a Mooncake call, which
    sends them in groups of 1, 2, 4... objects (a batched transfer is quicker than single ones;
    checksumming a group takes a fraction of the time sending the one before takes). The caller
    checksums group ``g + 1`` while the call sends group ``g`` (Mooncake's transfer runs without
    the GIL); it waits for the call to take group ``g`` before it starts on the next one, and
    the call takes it just before its transfer, so that the caller never holds the GIL when
    the call needs it (a thread waiting for the GIL waits up to the interpreter's switch
    interval, 5 ms). In such a pipeline the checksums cost about one object's worth."""

    def __init__(self, count: int) -> None:
        self.groups: list[tuple[int, int]] = []
        lo, size = 0, 1
        while lo < count:
            hi = count if count - lo < 3 * size else lo + size  # a short tail joins the last group
            self.groups.append((lo, hi))
            lo, size = hi, 2 * size
        self.started = threading.Event()
        self.given_up = threading.Event()  # the caller passed its deadline: send nothing more
        self.ready: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # None: the caller gave up
        self.taken: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # None: the call is over

    def feed(self, prepare: Callable[[int], None], deadline: float) -> BaseException | None:
        """The caller's side: ``prepare(j)`` each object in turn; what it raised, if it did.
        Gives up at ``deadline`` (the call is then abandoned by its caller)."""
        try:
            # the call's first RPC (put session start) runs while group 0 is checksummed
            if not self.started.wait(max(0.0, deadline - time.monotonic())):
                self.given_up.set()
                return None
            for lo, hi in self.groups:
                for j in range(lo, hi):
                    prepare(j)
                if time.monotonic() >= deadline:
                    self.given_up.set()
                    return None
                self.ready.put(lo)
                try:
                    if self.taken.get(timeout=max(0.0, deadline - time.monotonic())) is None:
                        return None
                except queue.Empty:
                    self.given_up.set()
                    return None
            return None
        except BaseException as exc:  # noqa: BLE001 - raised again once the call has ended
            return exc
        finally:
            self.ready.put(None)


def upload(store: MooncakeDistributedStore, staging: BufferPool, buf: torch.Tensor, spans: list[tuple[int, int]],
            names: list[str], srcs: list[torch.Tensor], sizes: list[int],
            relay: Relay) -> list[tuple[bool, int]]:
    """Put objects of ``sizes[j]`` bytes, header ``j`` at ``buf[spans[j][0]:]`` (``spans[j][1]``
    bytes, followed by the payload when it is smaller than ZERO_COPY_MIN) and the payload in
    ``srcs[j]`` (sent from where it lies). One put session start and one end for all; object
    ``j`` is sent once ``relay`` hands it over (see :class:`Relay`). Per object: (whether its
    put session opened, Mooncake's code). Holds ``buf`` and ``srcs`` (its arguments) until it
    ends."""
    sent: list[int | None] = [None] * len(names)
    registered: list[torch.Tensor] = []
    copies: list[torch.Tensor] = []
    try:
        relay.started.set()
        codes = start_sessions(store, names, sizes)
        for lo, hi in relay.groups:
            if relay.ready.get() is None or relay.given_up.is_set():
                break
            group, ptrs, lens, offsets = [], [], [], []
            for j in range(lo, hi):
                if codes[j] != 0:
                    continue
                src, (at, hlen), base = srcs[j], spans[j], buf.data_ptr()
                n = src.numel()
                group.append(j)
                if n < ZERO_COPY_MIN:
                    ptrs.append([base + at])
                    lens.append([hlen + n])
                    offsets.append([0])
                    continue
                if store.register_buffer(src.data_ptr(), n) == 0:
                    registered.append(src)
                else:  # it shares a page with registered memory, which Mooncake refuses to register twice
                    src = staging.take(n)
                    copies.append(src)
                    memoryview(src.numpy())[:n] = memoryview(srcs[j].numpy()).cast("B")
                ptrs.append([base + at, src.data_ptr()])
                lens.append([hlen, n])
                offsets.append([0, hlen])
            relay.taken.put(lo)  # the caller checksums the next group while this one is sent
            if group:
                got = store.batch_put_from_multi_buffer_ranges([names[j] for j in group], ptrs, lens, offsets)
                for j, g in zip(group, got, strict=True):
                    sent[j] = g
    finally:
        relay.taken.put(None)
        for src in registered:
            store.unregister_buffer(src.data_ptr())
        for copy in copies:
            staging.give(copy)
    out = [(rc == 0, rc) for rc in codes]
    failed = [j for j, rc in enumerate(codes) if rc == 0 and sent[j] != sizes[j]]
    if failed:
        store.batch_put_session_revoke([names[j] for j in failed])
        for j in failed:
            got = sent[j]
            out[j] = (True, got if got is not None and got < 0 else -1)
    done = [j for j, rc in enumerate(codes) if rc == 0 and sent[j] == sizes[j]]
    if done:
        for j, rc in zip(done, store.batch_put_session_end([names[j] for j in done]), strict=True):
            out[j] = (True, rc)
    return out


def download(store: MooncakeDistributedStore, head: torch.Tensor, names: list[str], sizes: list[int | None],
              outs: list[torch.Tensor]) -> list[tuple[int, int | None]]:
    """Read objects: header ``j`` into ``head[j * HEAD_PEEK:]``, payload straight into
    ``outs[j]``, in one batched transfer; unknown sizes are asked first. Per object: (its size or
    Mooncake's code for it, bytes read or Mooncake's code; None: not read, because its header
    would not fit HEAD_PEEK or ``outs[j]`` cannot be registered). Holds ``head`` and ``outs``
    (its arguments) until it ends."""
    result: list[tuple[int, int | None]] = []
    batch: list[int] = []
    base = head.data_ptr()
    try:
        for j, (name, size, out) in enumerate(zip(names, sizes, outs, strict=True)):
            size = store.get_size(name) if size is None else size
            hlen = size - out.numel()
            result.append((size, None))
            if size >= 0 and FIXED_BYTES + 16 <= hlen <= HEAD_PEEK and store.register_buffer(out.data_ptr(), out.numel()) == 0:
                batch.append(j)
        if not batch:
            return result
        got = store.batch_get_into_multi_buffers(
            [names[j] for j in batch],
            [[base + j * HEAD_PEEK, outs[j].data_ptr()] for j in batch],
            [[result[j][0] - outs[j].numel(), outs[j].numel()] for j in batch])
    finally:
        for j in batch:
            store.unregister_buffer(outs[j].data_ptr())
    for j, rc in zip(batch, got, strict=True):
        result[j] = (result[j][0], rc)
    return result


def download_whole(store: MooncakeDistributedStore, buf: torch.Tensor, names: list[str],
                   sizes: list[int]) -> list[int]:
    """Read objects of ``sizes`` whole into ``buf`` (a registered staging buffer), one after the
    other, in one batched transfer. Per object: bytes read or Mooncake's code. Holds ``buf``
    (its argument) until it ends."""
    ptrs, at = [], buf.data_ptr()
    for size in sizes:
        ptrs.append(at)
        at += size
    return store.batch_get_into(names, ptrs, sizes)
