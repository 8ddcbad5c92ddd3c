"""Client of the store daemon: the store API (lookup / load / save / prefetch) for processes that
share the daemon's DRAM arena, and its lease-level calls for engines that copy their own pages.

    client = StoreClient(socket, model="llama@rev", layout=layout)   # the namespace, in the hello
    hit = client.lookup(tokens)
    client.load(hit, out)                   # copies through read leases, validated
    client.save(tokens, kv)                 # writes through write leases

Every failure to reach the daemon -- down at start, killed mid-run, restarting, stalled past
``timeout_s``, of another protocol version, refusing this namespace, an arena this process
cannot map -- is a cache miss: logged once per outage, counted in :attr:`StoreClient.errors`,
never raised. The client reconnects (at most once per ``retry_s``) when the daemon is back.

The lease-level calls (``acquire`` / ``reserve`` and how long their views are valid) are
:class:`~kvtier.server.lease_client.LeaseClient`'s, which this client extends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvtier.core.keys import ChunkKey, chunk_tokens_of
from kvtier.core.session_hints import SessionHint
from kvtier.errors import DaemonUnavailable
from kvtier.server.lease_client import LeaseClient
from kvtier.store.packing import LayerKV, check_kv, pack_chunk, unpack_layer
from kvtier.store.results import LoadResult, LookupResult, SaveResult

log = logging.getLogger(__name__)

WAIT_TIMEOUT_S = 120.0


class StoreClient(LeaseClient):
    """The store API on the daemon's leases. Thread-safe; one connection at a time, requests
    serialized."""

    def _wait_timeout(self, wait: bool) -> float | None:
        """A call that waits for the daemon's SSD reads (a prefetch with ``wait``) may take
        longer than ``timeout_s``; timing out would lose every lease of the connection."""
        return max(self.timeout_s, WAIT_TIMEOUT_S) if wait else None

    # -- the store API --------------------------------------------------------------------------
    def lookup(self, tokens: object, *, tenant: str | None = None, request: str | None = None) -> LookupResult:
        layout = self._need_layout()
        chunks = chunk_tokens_of(tokens, self.namespace(), layout.chunk_tokens)
        tiers = self.lookup_keys(chunks.keys, num_tokens=chunks.num_tokens, tenant=tenant, request=request)
        c = layout.chunk_tokens
        return LookupResult(chunks.num_tokens, len(tiers) * c, chunks.keys[: len(tiers)], tiers)

    def lookup_keys(self, keys: Sequence[ChunkKey], *, num_tokens: int | None = None,
                    tenant: str | None = None, request: str | None = None) -> list[str]:
        """The tiers of the longest held prefix of ``keys`` (chunk keys of one sequence from its
        first chunk, of ``num_tokens`` tokens); empty if the daemon is unavailable. The daemon
        touches them for its policy and counts the lookup."""
        c = self._need_layout().chunk_tokens
        n = len(keys) * c if num_tokens is None else num_tokens
        try:
            _, reply = self._link.call("lookup", keys=list(keys), num_tokens=n, tenant=tenant, request=request)
            tiers = reply.get("tiers")
            if not isinstance(tiers, list) or len(tiers) > len(keys):
                raise DaemonUnavailable("the daemon's lookup reply is malformed")
        except DaemonUnavailable as exc:
            self._failed("lookup", exc)
            return []
        return [str(t) for t in tiers]

    def probe(self, keys: Sequence[ChunkKey], *, tenant: str | None = None,
              remote: bool = False) -> list[str | None]:
        """The fastest tier holding each of ``keys``, each on its own (None: not held, or the
        daemon is unavailable). Touches and counts nothing: it is for choosing among candidates
        (which partial chunk of a sequence is held), which a later acquire confirms. ``remote``:
        the daemon asks its remote tier for those it holds nowhere itself (one round trip: a
        partial chunk another machine saved), else answers from what it knows."""
        if not keys:
            return []
        try:
            extra = {"remote": True} if remote else {}
            _, reply = self._link.call("probe", keys=list(keys), tenant=tenant, **extra)
            tiers = reply.get("tiers")
            if not isinstance(tiers, list) or len(tiers) != len(keys) \
                    or not all(t is None or isinstance(t, str) for t in tiers):
                raise DaemonUnavailable("the daemon's probe reply is malformed")
        except DaemonUnavailable as exc:
            self._failed("probe", exc)
            return [None] * len(keys)
        return list(tiers)

    def load(self, hit: LookupResult, out: Sequence[LayerKV], *, layers: Sequence[int] | None = None,
             promote: bool = True, tenant: str | None = None, request: str | None = None) -> LoadResult:
        """Copy the hit's chunks from the shared arena into ``out`` (fewer tokens on failure).

        Chunks are pinned in rounds of what DRAM can hold at once (the daemon promotes chunks
        from SSD into free slots), copied, and released; a round whose lease turns out lost
        is not counted (``promote`` is accepted for the store's signature; the daemon always
        serves from DRAM)."""
        layout = self._need_layout()
        wanted = list(range(layout.num_layers)) if layers is None else list(layers)
        done = 0
        tiers: list[str] = []
        while done < len(hit.keys):
            lease = self.acquire(hit.keys[done:], first=done, tenant=tenant, request=request)
            if lease is None:
                break
            try:
                for j, view in enumerate(lease.views):
                    for layer in wanted:
                        lo = layout.layer_offset(layer)
                        unpack_layer(view[lo : lo + layout.layer_bytes], out[layer], done + j, layout)
            except BaseException:
                self.release(lease, took=[0] * len(lease.keys), failed=len(lease.keys))
                raise
            if not self.release(lease):
                break  # what this round copied may be another chunk's bytes: not used
            tiers.extend(lease.tiers)
            done += len(lease.views)
        tokens = done * layout.chunk_tokens
        return LoadResult(tokens=tokens, kv=[tuple(t[:, :tokens] for t in pair) for pair in out], tiers=tiers)

    def save(self, tokens: object, kv: Sequence[Sequence[torch.Tensor]], *, tenant: str | None = None,
             request: str | None = None) -> SaveResult:
        """Write the full chunks the daemon does not hold yet straight into the arena.

        Slots are reserved in rounds: once a round is committed its chunks can be demoted to
        make room for the next, as with a local store."""
        layout = self._need_layout()
        layers, kv_tokens = check_kv(kv, layout)
        keys = self.keys_for(tokens)[: kv_tokens // layout.chunk_tokens]
        stored = present = busy = done = 0
        while done < len(keys):
            lease = self.reserve(keys[done:], first=done, tenant=tenant, request=request)
            if lease is None or not lease.views:
                break  # no room at all (every resident chunk pinned), or the daemon is away
            present += sum(lease.held)
            busy += sum(1 for v, h in zip(lease.views, lease.held, strict=True) if v is None and not h)
            written: list[int] = []
            try:
                for i, view in enumerate(lease.views):
                    if view is not None:
                        pack_chunk(view, layers, done + i, layout)
                        written.append(i)
            finally:
                stored += self.commit(lease, written)
            done += len(lease.views)
        return SaveResult(stored=stored, present=present, dropped=len(keys) - done, busy=busy)

    def prefetch(self, keys: Sequence[ChunkKey], wait: bool = False, *, first: int = 0,
                 tenant: str | None = None, request: str | None = None) -> int:
        """Ask the daemon to bring the held prefix of ``keys`` into DRAM (in the background, or
        before replying with ``wait``); how many it promoted (0 when not waited for). With
        ``request``, the promotion is a use of that request's (not one of its own)."""
        try:
            _, reply = self._link.call("prefetch", self._wait_timeout(wait), keys=list(keys), first=first,
                                       wait=wait, tenant=tenant, request=request)
            return int(reply.get("promoted", 0))  # type: ignore[call-overload]
        except DaemonUnavailable as exc:
            self._failed("prefetch", exc)
            return 0

    def queued(self, request_id: str, keys: Sequence[ChunkKey], *, wait: bool = False,
               tenant: str | None = None, prefetch: bool = True, hint: SessionHint | None = None) -> int:
        """A request waits to be served: the daemon's policies hear of it and, unless not
        ``prefetch``, its held chunks are prefetched into DRAM
        (:meth:`kvtier.store.cache.ChunkCache.queued`). ``hint``: its session hint (the daemon
        ranks its session's chunks by it: :mod:`kvtier.core.sessions`). ``tenant`` binds the
        keys, as in every call; the hint's quota is ``hint.tenant``'s, else ``tenant``'s. 0 if
        unavailable."""
        extra = {"hint": hint.as_dict()} if hint is not None else {}
        try:
            _, reply = self._link.call("queued", self._wait_timeout(wait), request_id=request_id,
                                       keys=list(keys), wait=wait, tenant=tenant, prefetch=prefetch, **extra)
            return int(reply.get("promoted", 0))  # type: ignore[call-overload]
        except DaemonUnavailable as exc:
            self._failed("queued", exc)
            return 0

    def started(self, request_id: str) -> None:
        """The request is being served: its lookups, loads and saves (``request=``) are one use
        of each chunk for the daemon's policies."""
        try:
            self._link.call("started", request_id=request_id)
        except DaemonUnavailable as exc:
            self._failed("started", exc)

    def finished(self, request_id: str) -> None:
        try:
            self._link.call("finished", request_id=request_id)
        except DaemonUnavailable as exc:
            self._failed("finished", exc)

    def stats(self) -> dict[str, object]:
        """The daemon's snapshot; raises DaemonUnavailable (for ``kvtier store stats``)."""
        return self._link.call("stats")[1]["stats"]  # type: ignore[return-value]

    def request_loads(self, match: str = "", limit: int = 1024) -> dict[str, dict[str, object]]:
        """Request id (as the daemon names it: ``<instance>/<id>``) -> where its loads came from
        (tier -> tokens), what it held, what failed, how long its steps waited; the latest
        ``limit`` (at most 4096) ids containing ``match``, of the tenants this process's uid may
        use. Raises DaemonUnavailable."""
        found: list[dict[str, object]] = self._link.call("request_loads", match=match, limit=limit)[1]["requests"]  # type: ignore[assignment]
        return {str(rec.pop("request")): rec for rec in found}

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the daemon's background work (write-through copies, prefetches, uploads)
        is done; False on timeout or if the daemon is unavailable."""
        try:
            return bool(self._link.call("flush", timeout + self.timeout_s, timeout_s=int(timeout))[1].get("done"))
        except DaemonUnavailable as exc:
            self._failed("flush", exc)
            return False
