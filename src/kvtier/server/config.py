"""The daemon's configuration file (TOML) and how command-line flags override it.

    socket = "/run/kvtier/kvtier.sock"   # default: $KVTIER_SOCKET, $XDG_RUNTIME_DIR/kvtier.sock,
                                         # or /tmp/kvtier-<uid>/kvtier.sock
    policy = "lru"
    tenant = ""                          # the tenant of clients that name none
    write_through = false
    hint_share = 0.5                     # one tenant's retained sessions: at most this share of DRAM + SSD
    metrics_port = 9400                  # Prometheus on 127.0.0.1 (any path but /v1/)
    http_lookup = false                  # true: POST /v1/lookup on that port (kvtier.server.http)
    [host]
    capacity_bytes = "16GiB"             # sizes: an integer, or "16GiB", "500GB", "1.5T"
    extent_bytes = "256MiB"              # optional: DRAM moves between chunk sizes in these
    [disk]                               # optional
    path = "/nvme/kvtier"
    capacity_bytes = "500GiB"
    fsync = false
    o_direct = true
    codec = "none"                       # or "fp8", "int8", "int4" (lossy), "auto"
    max_kl = 0.005                       # auto: the quality a codec may cost (mean KL, nats)
    mode = "0600"                        # chunk files; directories get search permission too
    group = "inference"                  # optional: a group name or id
    [access]                             # optional
    mode = "0660"                        # socket and arena
    group = "inference"
    max_clients = 1024
    lease_ttl_s = 60                     # a lease held longer is ended (read) or fenced (write)
    orphan_report_s = 600                # orphaned write slots are reported (never freed) after
    [access.tenants]                     # optional: uid -> tenants it may use ("*": any other uid)
    "1001" = ["acme"]
    "*" = [""]
    [remote]                             # optional: the shared tier below SSD
    backend = "valkey"                   # or "mooncake"
    write = "through"                    # or "back"
    max_queued = 256
    [remote.valkey]                      # every field of ValkeyTierConfig
    addresses = ["10.0.0.5:6379"]
    capacity_bytes = "1TiB"
    codec = "none"                       # or "fp8", "int8", "int4": chunks stored compressed
    [remote.mooncake]                    # every field of MooncakeTierConfig (backend = "mooncake")
    master_address = "10.0.0.6:50051"
    capacity_bytes = "1TiB"

Every value is type-checked: a quoted boolean (``fsync = "no"``), a number where a name is
expected, a misspelt key are errors naming the key. The daemon serves any model, so there is no
``model`` or ``[layout]``: each client names its own in its hello.
"""

from __future__ import annotations

import dataclasses
import grp
import math
import tomllib
from collections.abc import Mapping

from kvtier.core.sizes import parse_size
from kvtier.errors import ConfigError
from kvtier.server.runtime import default_socket_path, ensure_socket_dir
from kvtier.server.settings import AccessConfig, DaemonConfig
from kvtier.store.cache import CacheConfig
from kvtier.store.config import RemoteConfig
from kvtier.tiers.disk_config import DiskTierConfig
from kvtier.tiers.host_config import HostTierConfig

_TOP = {"socket": "str", "policy": "str", "tenant": "str", "write_through": "bool", "hint_share": "float",
        "metrics_port": "int", "http_lookup": "bool", "host": "table", "disk": "table", "remote": "table", "access": "table"}
_HOST = {"capacity_bytes": "bytes", "extent_bytes": "bytes", "pin_memory": "bool"}
_DISK = {"path": "str", "capacity_bytes": "bytes", "fsync": "bool", "o_direct": "bool",
         "mode": "mode", "group": "group", "codec": "str", "max_kl": "float"}
_ACCESS = {"mode": "mode", "group": "group", "max_clients": "int", "lease_ttl_s": "seconds",
           "orphan_report_s": "seconds", "tenants": "table"}
_REMOTE = {"backend": "str", "write": "str", "max_queued": "int", "verify_s": "seconds", "miss_s": "seconds",
           "valkey": "table", "mooncake": "table"}
_GONE = {"model": "the daemon serves any model: clients name theirs in their hello",
         "model_dir": "the daemon serves any model: clients name theirs in their hello",
         "layout": "the daemon serves any layout: clients name theirs in their hello",
         "orphan_grace_s": "orphaned write slots are no longer freed after a grace period (a late "
                           "write would land in another chunk); orphan_report_s sets when they are "
                           "reported as quarantined"}


def read_toml(path: str) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc


def _value(where: str, kind: str, value: object) -> object:
    """``value`` of config key ``where`` as ``kind`` wants it, or ConfigError naming the key."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"config key {where} must be {what}, got {value!r}")

    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false (unquoted)")
        return value
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("an integer")
        return value
    if kind == "seconds":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise bad("a number of seconds")
        return float(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise bad("a number >= 0")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if kind == "bytes":
        try:
            return parse_size(value, f"config key {where}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if kind == "mode":
        if isinstance(value, str) and value and all(c in "01234567" for c in value.removeprefix("0o")):
            return int(value.removeprefix("0o"), 8)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad('an octal mode like "0600" or "0660"')
    if kind == "group":
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if isinstance(value, str) and value:
            if value.isdigit():
                return int(value)
            try:
                return grp.getgrnam(value).gr_gid
            except KeyError:
                raise ConfigError(f"config key {where}: no group named {value!r}") from None
        raise bad("a group name or id")
    if kind == "table":
        if not isinstance(value, Mapping):
            raise bad("a table")
        return value
    raise AssertionError(kind)  # pragma: no cover


def _section(raw: Mapping[str, object], where: str, schema: Mapping[str, str]) -> dict[str, object]:
    unknown = set(raw) - set(schema)
    if unknown:
        hint = "; ".join(f"{k}: {_GONE[k]}" for k in sorted(unknown) if k in _GONE)
        raise ConfigError(f"unknown key(s) in {where}: {sorted(unknown)}; allowed: {sorted(schema)}"
                          + (f" ({hint})" if hint else ""))
    prefix = f"{where.strip('[]')}." if where != "the config" else ""
    return {k: _value(prefix + k, schema[k], v) for k, v in raw.items()}


def _build(cls: type, where: str, kwargs: Mapping[str, object]) -> object:
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"config section [{where}]: {exc}") from exc


def _annotation_kind(name: str, annotation: str) -> str | None:
    """The kind to check a remote tier's field as, from its dataclass annotation."""
    ann = annotation.replace(" ", "")
    if name.endswith("_bytes") and ann.startswith("int"):
        return "bytes"
    base = ann.split("|")[0]
    return {"bool": "bool", "int": "int", "float": "seconds", "str": "str"}.get(base)


def _remote(data: Mapping[str, object]) -> RemoteConfig:
    data = _section(data, "[remote]", _REMOTE)
    backend = data.get("backend")
    if backend == "valkey":
        from kvtier.tiers.valkey import ValkeyTierConfig as cls
    elif backend == "mooncake":
        from kvtier.tiers.mooncake import MooncakeTierConfig as cls  # type: ignore[assignment]
    else:
        raise ConfigError(f"[remote] backend must be 'valkey' or 'mooncake', got {backend!r}")
    sub = data.get(backend)
    if not isinstance(sub, Mapping):
        raise ConfigError(f"config section [remote.{backend}] is missing or not a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(sub) - set(fields)
    if unknown:
        raise ConfigError(f"unknown key(s) in [remote.{backend}]: {sorted(unknown)}; allowed: {sorted(fields)}")
    kwargs: dict[str, object] = {}
    for k, v in sub.items():
        kind = _annotation_kind(k, str(fields[k].type))
        if isinstance(v, list):  # TOML arrays are lists; the configs are frozen: tuples
            if not all(isinstance(x, str) for x in v):
                raise ConfigError(f"config key remote.{backend}.{k} must be a list of strings")
            kwargs[k] = tuple(v)
        else:
            kwargs[k] = _value(f"remote.{backend}.{k}", kind, v) if kind else v
    tier = _build(cls, f"remote.{backend}", kwargs)
    try:
        return RemoteConfig(tier, write=str(data.get("write", "through")),  # type: ignore[call-overload]
                            max_queued=int(data.get("max_queued", 256)),  # type: ignore[call-overload]
                            verify_s=float(data.get("verify_s", 5.0)), miss_s=float(data.get("miss_s", 1.0)))  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigError(f"config section [remote]: {exc}") from exc


def _access(data: Mapping[str, object]) -> AccessConfig:
    data = _section(data, "[access]", _ACCESS)
    tenants = data.pop("tenants", None)
    if tenants is not None:
        parsed: dict[str, tuple[str, ...]] = {}
        for uid, names in tenants.items():  # type: ignore[union-attr]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ConfigError(f"config key access.tenants.{uid} must be a list of tenant names")
            parsed[str(uid)] = tuple(names)
        data["tenants"] = parsed
    return _build(AccessConfig, "access", data)  # type: ignore[return-value]


def daemon_config(raw: Mapping[str, object]) -> DaemonConfig:
    """Build and validate a DaemonConfig from a parsed config (file merged with flags)."""
    top = _section(raw, "the config", _TOP)
    if top.get("host") is None:
        raise ConfigError("config section [host] is missing (the DRAM tier: capacity_bytes)")
    try:
        host = _build(HostTierConfig, "host", _section(top["host"], "[host]", _HOST))  # type: ignore[arg-type]
        disk = None
        if top.get("disk") is not None:
            disk = _build(DiskTierConfig, "disk", _section(top["disk"], "[disk]", _DISK))  # type: ignore[arg-type]
        remote = _remote(top["remote"]) if top.get("remote") is not None else None  # type: ignore[arg-type]
        access = _access(top["access"]) if top.get("access") is not None else AccessConfig()  # type: ignore[arg-type]
        cache = CacheConfig(host=host, disk=disk, remote=remote,  # type: ignore[arg-type]
                            policy=str(top.get("policy", "lru")),
                            write_through=bool(top.get("write_through", False)),
                            hint_share=float(top.get("hint_share", 0.5)))  # type: ignore[arg-type]
        socket_path = str(top.get("socket") or default_socket_path())
        ensure_socket_dir(socket_path)
        port = top.get("metrics_port")
        lookup = bool(top.get("http_lookup", False))
        if lookup and port is None:
            raise ConfigError("http_lookup = true needs metrics_port (the lookup is served on that port)")
        return DaemonConfig(socket_path=socket_path, cache=cache, tenant=str(top.get("tenant", "")),
                            metrics_port=port, http_lookup=lookup, access=access)  # type: ignore[arg-type]
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc
