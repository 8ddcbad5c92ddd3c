"""The daemon's operations: one function per request ``op``, in :data:`OPS`.

Each takes the daemon (what it uses of it: :class:`~kvtier.server.session.OpsDaemon`), the
request (checked field by field: :mod:`kvtier.server.protocol`) and the client's session, and
returns the reply. What a lease is and how it ends:
:mod:`kvtier.server.leases`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.core.mover import Shape
from kvtier.core.session_hints import HintError, parse_hint
from kvtier.errors import TierFullError
from kvtier.server import protocol
from kvtier.server.leases import Lease
from kvtier.server.protocol import BadRequest
from kvtier.server.session import OpsDaemon, Session
from kvtier.server.settings import ClientNamespace, parse_namespace
from kvtier.store.cache import Slot
from kvtier.tiers.base import Reservation

DEFAULT_BUDGET_MS = 1000


def _deadline(req: dict[str, object]) -> float:
    """When an acquire or reserve must answer by (the client's budget, within its timeout)."""
    budget = req.get("budget_ms", DEFAULT_BUDGET_MS)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise BadRequest(f"budget_ms must be an integer, got {budget!r:.40}")
    return time.monotonic() + min(max(budget, 1), 60_000) / 1000


def hello(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    version = req.get("version")
    if version != protocol.VERSION:
        return {"ok": False, "refused": True,
                "error": f"protocol version {version!r} is not this daemon's ({protocol.VERSION})"}
    if session.client:
        raise BadRequest("this connection has said hello already")
    client = req.get("client")
    if not isinstance(client, bytes) or len(client) != 16:
        raise BadRequest("hello needs a 16-byte client id")
    assert daemon.cache is not None
    if req.get("namespace") is not None:
        ns = parse_namespace(req["namespace"], daemon.config.tenant)
        if not daemon.config.access.allowed(session.peer.uid, ns.tenant):
            return {"ok": False, "refused": True,
                    "error": f"uid {session.peer.uid} may not use tenant {ns.tenant!r}"}
        refusal = _cannot_hold(daemon, ns)
        if refusal:
            return {"ok": False, "refused": True, "error": refusal}
        session.ns = ns
    session.client = client
    session.instance = protocol.text(req, "instance") or f"pid{session.peer.pid}"
    host = daemon.cache.host
    return {"ok": True, "version": protocol.VERSION, "epoch": daemon.epoch,
            "shm_name": host.arena.shm_name, "arena_bytes": host.arena.size,
            "tiers": [t.name for t in daemon.cache.tiers],
            "tenant": session.ns.tenant if session.ns else daemon.config.tenant}

def _cannot_hold(daemon: OpsDaemon, ns: ClientNamespace) -> str | None:
    assert daemon.cache is not None
    shape = ns.shape
    try:
        daemon.cache.host.stride_for(shape.nbytes)
    except ValueError as exc:
        return f"this daemon cannot hold chunks of this layout: {exc}"
    for tier in daemon.cache.tiers[1:]:
        if tier.footprint(shape.nbytes, shape.segment_bytes) > tier.capacity:
            return (f"this daemon cannot hold chunks of this layout: a chunk of {shape.nbytes} "
                    f"bytes is larger than the {tier.name} tier ({tier.capacity} bytes)")
    return None

def lookup(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    ns, keys, tenant = daemon.bound(session, req)
    c = ns.layout.chunk_tokens
    n = protocol.integer(req, "num_tokens", len(keys) * c, len(keys) * c + c - 1, default=len(keys) * c)
    assert daemon.cache is not None
    hit = daemon.cache.lookup_keys(keys, use=daemon.use_of(req, session, arrived=True), tokens=(n, c),
                                   tenant=tenant)
    return {"ok": True, "tiers": [daemon.cache.tiers[lvl].name for lvl in hit.levels]}

def probe(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    _, keys, tenant = daemon.bound(session, req)
    remote = req.get("remote", False)
    if not isinstance(remote, bool):
        raise BadRequest(f"probe remote must be true or false, got {remote!r:.40}")
    assert daemon.cache is not None
    names = [t.name for t in daemon.cache.tiers]
    held = daemon.cache.held(keys, tenant=tenant, remote=remote)
    return {"ok": True, "tiers": [None if lvl is None else names[lvl] for lvl in held]}

def _entry_shapes(req: dict[str, object], ns: ClientNamespace, count: int) -> tuple[Shape, Shape | None]:
    """(the shape of a full chunk, the shape of the request's last chunk when ``tail_tokens``
    says it is a partial one): a partial chunk of ``t`` tokens is its own size, ``t`` tokens of
    every layer, in every tier."""
    lay = ns.layout
    tail = protocol.integer(req, "tail_tokens", 0, lay.chunk_tokens - 1, default=0)
    if tail and not count:
        raise BadRequest("tail_tokens names the last chunk of a request with no chunks")
    return ns.shape, (Shape(lay.part_bytes(tail), lay.part_layer_bytes(tail)) if tail else None)


def _unique(keys: list[object]) -> None:
    if len(set(keys)) != len(keys):  # a pin or a slot per key: [k, k] would take k twice
        raise BadRequest("keys: the same chunk key appears twice in one request")


def acquire(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    ns, keys, tenant = daemon.bound(session, req)
    _unique(keys)
    lease_id = protocol.integer(req, "lease", 1, protocol.MAX_LEASE)
    first = protocol.integer(req, "first", 0, protocol.MAX_KEYS * 256, default=0)
    full, tail = _entry_shapes(req, ns, len(keys))
    if daemon.leases.holds(session.leases, lease_id):
        raise BadRequest(f"lease {lease_id} is already held on this connection")
    assert daemon.cache is not None
    use = daemon.use_of(req, session)
    held = daemon.cache.acquire(keys, entry=full, last_entry=tail, start=first, use=use,
                                deadline=_deadline(req), tenant=tenant)
    # every chunk handed out must be exactly the size the client will read: a chunk saved
    # with another size under this key (a client of this namespace that lied) ends the lease
    # there, never a view over another entry's bytes
    want = [full.nbytes] * len(keys)
    if tail is not None:
        want[-1] = tail.nbytes
    good = next((i for i, h in enumerate(held) if h.nbytes != want[i]), len(held))
    if good < len(held):
        daemon.cache.release([h.key for h in held[good:]])
        held = held[:good]
    if held:
        daemon.leases.grant(session.leases, Lease(lease_id, session.client, False, [h.key for h in held],
                                                  first, use, sources=[h.source for h in held],
                                                  request=daemon.request_name(session, protocol.text(req, "request")),
                                                  tenant=tenant))
    return {"ok": True, "lease": lease_id if held else None, "slots": [h.offset for h in held],
            "tiers": [h.source for h in held]}

def release(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    lease_id = protocol.integer(req, "lease", 1, protocol.MAX_LEASE)
    lease = daemon.leases.take(session.leases, lease_id, write=False)
    ns = daemon.namespace_of(session)
    assert daemon.cache is not None
    daemon.cache.release(lease.keys)
    try:
        took = protocol.integers(req, "took", 0, ns.layout.chunk_tokens, limit=len(lease.keys))
        had = protocol.integer(req, "had", 0, protocol.MAX_TOKENS, default=0)
        failed = protocol.integer(req, "failed", 0, len(lease.keys), default=0)
        wait_ms = protocol.integer(req, "wait_ms", 0, 3_600_000, default=0)
    except BadRequest:
        return {"ok": True}  # the pins are released anyway; a bad report is not counted
    daemon.cache.count_loaded(zip(lease.sources, took, strict=False), had=had, failed=failed)
    if lease.request is not None and "wait_ms" in req:  # (one rank of an engine says so)
        daemon.request_loads.record(lease.request, zip(lease.sources, took, strict=False), had=had,
                                    failed=failed, wait_s=wait_ms / 1000, tenant=lease.tenant)
    return {"ok": True}


def request_loads(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    """Per request (ids containing ``match``, of the tenants the caller's uid may use): the tokens
    it loaded from each tier, what it held, what failed, how long its steps waited
    (:mod:`kvtier.server.request_loads`)."""
    part = protocol.text(req, "match") or ""
    limit = protocol.integer(req, "limit", 1, 4096, default=1024)
    uid = session.peer.uid
    return {"ok": True, "requests": daemon.request_loads.matching(
        part, limit, lambda tenant: daemon.config.access.allowed(uid, tenant))}

def reserve(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    ns, keys, tenant = daemon.bound(session, req)
    _unique(keys)
    lease_id = protocol.integer(req, "lease", 1, protocol.MAX_LEASE)
    first = protocol.integer(req, "first", 0, protocol.MAX_KEYS * 256, default=0)
    full, tail = _entry_shapes(req, ns, len(keys))
    if daemon.leases.holds(session.leases, lease_id):
        raise BadRequest(f"lease {lease_id} is already held on this connection")
    assert daemon.cache is not None
    lease = Lease(lease_id, session.client, True, keys, first, daemon.use_of(req, session, finished=True))
    slots: list[int] = []
    present = busy = 0
    deadline = _deadline(req)
    try:
        for i, key in enumerate(keys):
            if i and time.monotonic() > deadline:
                break  # answer within the client's timeout: it asks again for the rest
            shape = tail if tail is not None and i == len(keys) - 1 else full
            try:
                res = daemon.cache.reserve(key, shape, position=first + i, remaining=len(keys) - i,
                                           deadline=deadline, fmt=ns.fmt, tenant=tenant)
            except TierFullError:
                break
            if res is Slot.HELD:
                slots.append(-1)  # already held: nothing to write
                present += 1
            elif res is Slot.BUSY:
                slots.append(-2)  # another client is writing it now: skip it
                busy += 1
            else:
                assert isinstance(res, Reservation)
                lease.writes[i] = res
                slots.append(int(res.slot))  # type: ignore[call-overload]
    except BaseException:
        for res in lease.writes.values():
            daemon.cache.commit(res, ok=False)
        raise
    daemon.cache.count(dedup_chunks=present, busy_chunks=busy)
    if lease.writes:
        daemon.leases.grant(session.leases, lease)
    return {"ok": True, "lease": lease_id if lease.writes else None, "slots": slots}

def commit(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    lease_id = protocol.integer(req, "lease", 1, protocol.MAX_LEASE)
    lease = daemon.leases.take(session.leases, lease_id, write=True)
    assert daemon.cache is not None
    try:
        written = set(protocol.integers(req, "written", 0, protocol.MAX_KEYS))
        protocol.within(list(written), len(lease.keys), "written")
        ok = req.get("success", True) is True
    except BadRequest:
        for res in lease.writes.values():
            daemon.cache.commit(res, ok=False)
        raise
    done = 0
    for i, res in lease.writes.items():
        done += bool(daemon.cache.commit(res, ok=ok and i in written, position=lease.first + i))
    if done:
        daemon.cache.touch(lease.keys, start=lease.first, use=lease.use)
    return {"ok": True, "committed": done}

def forget(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    ids = protocol.integers(req, "leases", 1, protocol.MAX_LEASE)
    lost = protocol.integer(req, "lost_chunks", 0, protocol.MAX_KEYS * 64, default=0)
    assert daemon.cache is not None
    daemon.cache.count(engine_load_failures=lost)  # what the client threw away, lost leases
    return {"ok": True, "freed": daemon.leases.forget(session.client, ids, session.owner)}

def prefetch(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    ns, keys, tenant = daemon.bound(session, req)
    first = protocol.integer(req, "first", 0, protocol.MAX_KEYS * 256, default=0)
    wait = req.get("wait", False) is True
    assert daemon.cache is not None
    n = daemon.cache.prefetch(keys, start=first, use=daemon.use_of(req, session), entry=ns.shape, wait=wait,
                              tenant=tenant)
    return {"ok": True, "promoted": n}

def queued(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    ns, keys, tenant = daemon.bound(session, req)
    request_id = protocol.text(req, "request_id")
    if not request_id:
        raise BadRequest("queued needs a request_id")
    wait = req.get("wait", False) is True
    prefetch = req.get("prefetch", True)
    if not isinstance(prefetch, bool):
        raise BadRequest(f"queued prefetch must be true or false, got {prefetch!r}")
    hint = None
    if req.get("hint") is not None:  # the request's session hint (kvtier.core.session_hints)
        try:
            hint = parse_hint(req["hint"], "hint", internal=True)
        except HintError as exc:
            raise BadRequest(str(exc)) from None
    assert daemon.cache is not None
    name = daemon.request_name(session, request_id)
    return {"ok": True, "promoted": daemon.cache.queued(name, keys, entry=ns.shape, wait=wait,  # type: ignore[arg-type]
                                                        tenant=tenant, prefetch=prefetch, hint=hint)}

def started(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    request_id = protocol.text(req, "request_id")
    if not request_id:
        raise BadRequest("started needs a request_id")
    assert daemon.cache is not None
    daemon.cache.started(daemon.request_name(session, request_id))  # type: ignore[arg-type]
    return {"ok": True}

def finished(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    request_id = protocol.text(req, "request_id")
    if request_id:
        assert daemon.cache is not None
        daemon.cache.finished(daemon.request_name(session, request_id))  # type: ignore[arg-type]
    return {"ok": True}

def stats(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    return {"ok": True, "stats": daemon.snapshot()}

def flush(daemon: OpsDaemon, req: dict[str, object], session: Session) -> dict[str, object]:
    timeout = protocol.integer(req, "timeout_s", 0, 3600, default=30)
    assert daemon.cache is not None
    return {"ok": True, "done": daemon.cache.flush(timeout)}


OPS: dict[str, Callable[[OpsDaemon, dict[str, object], Session], dict[str, object]]] = {
    "hello": hello,
    "lookup": lookup,
    "probe": probe,
    "acquire": acquire,
    "release": release,
    "reserve": reserve,
    "commit": commit,
    "forget": forget,
    "prefetch": prefetch,
    "queued": queued,
    "started": started,
    "finished": finished,
    "stats": stats,
    "request_loads": request_loads,
    "flush": flush,
}
"""Operation name -> handler."""
