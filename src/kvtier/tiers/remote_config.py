"""Typed configs of the remote tiers, validated when made (ValueError naming the field).

Both tiers take ``capacity_bytes`` (headers included), a key ``prefix`` (a namespace: processes
that share a prefix share chunks), ``timeout_s`` (the longest wait for the server) and
``reconnect_interval_s`` (how often a tier that is down tries again), and ``codec``: ``"none"``
(the default) stores chunks as they are; ``"fp8"``, ``"int8"`` or ``"int4"`` stores KV chunks
through that lossy codec (:mod:`kvtier.tiers.codecs`), 2-4x smaller. A tier reads chunks of any
codec back, whatever its own, so processes sharing a prefix may differ in it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvtier.tiers.codec_types import check_codec


def check_positive_int(value: object, field: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field} must be a positive int, got {value!r}")


def check_seconds(value: object, field: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        raise ValueError(f"{field} must be a positive number of seconds, got {value!r}")


def check_prefix(value: object, field: str) -> None:
    """Printable ASCII without blanks or braces (braces are Valkey cluster hash tags)."""
    if not isinstance(value, str) or not value or not value.isascii() or not value.isprintable():
        raise ValueError(f"{field} must be a non-empty printable ASCII string, got {value!r}")
    if any(c in value for c in " {}"):
        raise ValueError(f"{field} must not contain blanks or braces, got {value!r}")


def parse_address(value: object, field: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ValueError naming ``field`` otherwise."""
    if isinstance(value, str) and value.count(":") == 1:
        host, port = value.split(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return host, int(port)
    raise ValueError(f"{field} must be 'host:port', got {value!r}")


@dataclass(frozen=True)
class ValkeyTierConfig:
    addresses: tuple[str, ...]
    """``host:port`` of the server, or of some cluster nodes (the client discovers the rest)."""
    capacity_bytes: int
    """Budget for all processes sharing ``prefix``, headers included; keep it below maxmemory."""
    cluster: bool = False
    prefix: str = "kvtier"
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_ca_file: str | None = None
    ssl_cert_file: str | None = None
    ssl_key_file: str | None = None
    timeout_s: float = 1.0
    """Longest wait for one server reply (connect, send and receive each)."""
    reconnect_interval_s: float = 1.0
    reservation_ttl_s: float = 600.0
    """An uncommitted reservation older than this is presumed dead and released."""
    tenant_prefixes: bool = False
    """Keep each tenant's chunks under ``<prefix>.t.<tenant>`` (``<prefix>.shared`` for the empty
    tenant), each with this budget, so that server ACLs can confine an instance to its tenants
    (:mod:`kvtier.tiers.tenants`)."""
    codec: str = "none"
    """Store KV chunks through this lossy codec (``fp8``, ``int8``, ``int4``; see the module
    docstring)."""

    def __post_init__(self) -> None:
        check_codec(self.codec, "valkey")
        if not isinstance(self.tenant_prefixes, bool):
            raise ValueError(f"valkey tenant_prefixes must be true or false, got {self.tenant_prefixes!r}")
        if isinstance(self.addresses, str) or not self.addresses:
            raise ValueError(f"valkey addresses must be a non-empty tuple of 'host:port', got {self.addresses!r}")
        for a in self.addresses:
            parse_address(a, "valkey addresses")
        if not self.cluster and len(self.addresses) != 1:
            raise ValueError("valkey addresses must hold exactly one server unless cluster=True")
        check_positive_int(self.capacity_bytes, "valkey capacity_bytes")
        check_prefix(self.prefix, "valkey prefix")
        for field in ("timeout_s", "reconnect_interval_s", "reservation_ttl_s"):
            check_seconds(getattr(self, field), f"valkey {field}")
        for field in ("username", "password"):
            if getattr(self, field) is not None and not isinstance(getattr(self, field), str):
                raise ValueError(f"valkey {field} must be a string or None")
        if self.username is not None and self.password is None:
            raise ValueError("valkey username needs a password")
        for field in ("ssl_ca_file", "ssl_cert_file", "ssl_key_file"):
            path = getattr(self, field)
            if path is not None and not self.ssl:
                raise ValueError(f"valkey {field} is set but ssl is off")
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"valkey {field} {path!r} is not a readable file")
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ValueError("valkey ssl_cert_file and ssl_key_file go together")


@dataclass(frozen=True)
class MooncakeTierConfig:
    master_address: str
    """``host:port`` of the Mooncake master."""
    capacity_bytes: int
    """This process's budget (headers included); see the module docstring."""
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_names: str = ""
    """RDMA devices (protocol "rdma" only)."""
    global_segment_bytes: int = 0
    """Memory this process lends to the pool (0: data lives in other processes)."""
    local_buffer_bytes: int = 16 << 20
    prefix: str = "kvtier"
    timeout_s: float = 2.0
    reconnect_interval_s: float = 1.0
    workers: int = 4
    """Threads that run Mooncake calls (a stalled server can hold each up to Mooncake's own 30 s)."""
    codec: str = "none"
    """Store KV chunks through this lossy codec (``fp8``, ``int8``, ``int4``; see the module
    docstring)."""

    def __post_init__(self) -> None:
        check_codec(self.codec, "mooncake")
        parse_address(self.master_address, "mooncake master_address")
        check_positive_int(self.capacity_bytes, "mooncake capacity_bytes")
        for field in ("metadata_server", "local_hostname"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"mooncake {field} must be a non-empty string, got {getattr(self, field)!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not isinstance(self.device_names, str):
            raise ValueError(
                f"mooncake device_names must be a string, got {self.device_names!r}")
        for field in ("global_segment_bytes", "local_buffer_bytes"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"mooncake {field} must be an int >= 0, got {v!r}")
        check_prefix(self.prefix, "mooncake prefix")
        check_seconds(self.timeout_s, "mooncake timeout_s")
        check_seconds(self.reconnect_interval_s, "mooncake reconnect_interval_s")
        check_positive_int(self.workers, "mooncake workers")
