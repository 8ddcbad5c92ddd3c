"""The store daemon's settings (:class:`DaemonConfig`, :class:`AccessConfig`) and the namespace a
client names in its hello (:class:`ClientNamespace`), checked."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from kvtier.core.keys import Namespace
from kvtier.core.layout import KVLayout
from kvtier.core.mover import Shape
from kvtier.server import protocol
from kvtier.server.protocol import BadRequest
from kvtier.store.cache import CacheConfig
from kvtier.tiers.codec_types import KVFormat

ANY_UID = "*"


def _octal(mode: object) -> str:
    return oct(mode) if isinstance(mode, int) and not isinstance(mode, bool) else repr(mode)


@dataclass(frozen=True)
class AccessConfig:
    """Who may use the daemon, and how much of it."""

    mode: int = 0o600
    """Permissions of the socket and the arena. Engines running as other users need group
    access (0o660) and ``group``."""
    group: int | None = None
    """Group id given the socket and the arena (None: the daemon's)."""
    tenants: dict[str, tuple[str, ...]] | None = None
    """uid (as a string, or ``"*"`` for any other uid) -> the tenants it may use. None: any
    uid may use any tenant. A uid with no entry and no ``"*"`` is refused."""
    max_clients: int = 1024
    """Connections served at once; more are refused (counted), never left to fail mid-read."""
    lease_ttl_s: float = 60.0
    """How long a lease may be held, on a live connection too: a read lease past it is ended
    (its pins released, its holder's release refused), a write lease fenced (never committed;
    its slots stay reserved until its holder ends it). See :mod:`kvtier.server.leases`."""
    orphan_report_s: float = 600.0
    """How long the DRAM slots of a write lease whose connection ended may stay reserved, its
    client neither saying it stopped writing them nor exiting, before a warning reports them
    as quarantined. They are never freed by time (a late write would land in another chunk)."""

    def __post_init__(self) -> None:
        if (not isinstance(self.mode, int) or isinstance(self.mode, bool) or self.mode & ~0o660
                or self.mode & 0o600 != 0o600):
            raise ValueError(
                f"access mode must be 0o600 or 0o660, or 0o640 (the owner reads and writes; a group "
                f"may be let in), got {_octal(self.mode)}: every process that can open the socket "
                "maps the whole arena and reads every tenant's KV, so no access for other users, "
                "and no execute bits")
        if self.group is not None and (not isinstance(self.group, int) or self.group < 0):
            raise ValueError(f"access group must be a group id, got {self.group!r}")
        if not isinstance(self.max_clients, int) or not 1 <= self.max_clients <= 1 << 20:
            raise ValueError(f"access max_clients must be an int in [1, 1048576], got {self.max_clients!r}")
        for name in ("lease_ttl_s", "orphan_report_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"access {name} must be a number of seconds > 0, got {value!r}")
        if self.tenants is not None:
            for uid, names in self.tenants.items():
                if uid != ANY_UID and not (isinstance(uid, str) and uid.isdigit()):
                    raise ValueError(f"access tenants: keys are uids or '*', got {uid!r}")
                if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
                    raise ValueError(f"access tenants[{uid!r}] must be a list of tenant names")

    def allowed(self, uid: int, tenant: str) -> bool:
        if self.tenants is None:
            return True
        names = self.tenants.get(str(uid), self.tenants.get(ANY_UID))
        return names is not None and tenant in names


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: str
    cache: CacheConfig
    tenant: str = ""
    """The tenant of clients that name none."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1:PORT (0: any free port; None: off)."""
    http_lookup: bool = False
    """Also answer ``POST /v1/lookup`` and ``GET /v1/namespaces`` on that port (every local
    user may then ask which prefixes the readable tenants hold: :mod:`kvtier.server.http`)."""
    access: AccessConfig = field(default_factory=AccessConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.socket_path, str) or not self.socket_path:
            raise ValueError("socket_path must not be empty")
        parent = os.path.dirname(os.path.abspath(self.socket_path))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ValueError(f"cannot create the socket {self.socket_path}: {parent} is not a writable directory")
        if len(os.fsencode(self.socket_path)) > 100:
            raise ValueError(f"socket path {self.socket_path!r} is too long for a Unix socket")
        if self.cache.chunk is not None:
            raise ValueError("a daemon's cache serves any model: its config must not fix a chunk shape")
        if not isinstance(self.tenant, str):
            raise ValueError(f"tenant must be a string, got {self.tenant!r}")
        if self.metrics_port is not None and (not isinstance(self.metrics_port, int)
                                              or isinstance(self.metrics_port, bool)
                                              or not 0 <= self.metrics_port <= 65535):
            raise ValueError(f"metrics_port must be a TCP port in [0, 65535], got {self.metrics_port!r}")


@dataclass(frozen=True, slots=True)
class ClientNamespace:
    """What a connection's chunks are: the namespace its hello named."""

    model: str
    layout: KVLayout
    page_format: str
    tenant: str

    @property
    def shape(self) -> Shape:
        return Shape(self.layout.chunk_bytes, self.layout.layer_bytes)

    @property
    def fmt(self) -> KVFormat | None:
        """What this client's chunk bytes are, for the tiers' codecs. kvtier's own layout holds K
        then V of each layer (keys quantized per channel); an engine's pages (``page_format``)
        interleave K and V in a backend's own order, so they are quantized per row of
        ``head_dim`` elements, whatever each row is."""
        fmt = KVFormat.of_layout(self.layout)
        if fmt is None or not self.page_format:
            return fmt
        return KVFormat(fmt.dtype, fmt.head_dim, 1)

    def namespace(self, tenant: str) -> Namespace:
        layout_id = self.layout.fingerprint + (f"/{self.page_format}" if self.page_format else "")
        return Namespace(self.model, layout_id, tenant)


_LAYOUT_BOUNDS = {"num_layers": 4096, "num_kv_heads": 4096, "head_dim": 1 << 16,
                  "chunk_tokens": 1 << 20, "kv": 2}


def parse_namespace(raw: object, default_tenant: str) -> ClientNamespace:
    """The namespace of a hello, checked (BadRequest naming the field)."""
    if not isinstance(raw, dict):
        raise BadRequest("namespace must be a map")
    model = protocol.text(raw, "model")
    if not model:
        raise BadRequest("namespace.model must be a non-empty string")
    lay = raw.get("layout")
    if not isinstance(lay, dict) or set(lay) - {*_LAYOUT_BOUNDS, "dtype"}:
        raise BadRequest(f"namespace.layout must be a map of {sorted({*_LAYOUT_BOUNDS, 'dtype'})}")
    args = {name: protocol.integer(lay, name, 1, hi, default=2 if name == "kv" else None)
            for name, hi in _LAYOUT_BOUNDS.items()}
    dtype = protocol.text(lay, "dtype", "float32")
    try:
        layout = KVLayout(dtype=dtype, **args)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"namespace.layout: {exc}") from None
    tenant = protocol.text(raw, "tenant")
    return ClientNamespace(model, layout, protocol.text(raw, "page_format", "") or "",
                           default_tenant if tenant is None else tenant)
