"""The daemon's configuration file (TOML) and how command-line flags override it.

    socket = "/run/kvtier/kvtier.sock"
    model = "llama-3-8b@rev"          # or model_dir = "/models/llama" (fingerprint + layout)
    policy = "lru"
    write_through = false
    metrics_port = 9400
    [layout]                          # not needed with model_dir
    num_layers = 32
    num_kv_heads = 8
    head_dim = 128
    dtype = "bfloat16"
    chunk_tokens = 256
    [host]
    capacity_bytes = 17179869184
    [disk]                            # optional
    path = "/nvme/kvtier"
    capacity_bytes = 536870912000
    fsync = false
    o_direct = true
    [remote]                          # optional: the shared tier below SSD
    backend = "valkey"                # or "mooncake"
    write = "through"                 # or "back"
    max_queued = 256
    [remote.valkey]                   # every field of ValkeyTierConfig
    addresses = ["10.0.0.5:6379"]
    capacity_bytes = 1099511627776
    cluster = false
    password = "secret"               # and username, ssl, ssl_ca_file, ssl_cert_file, ssl_key_file
    [remote.mooncake]                 # every field of MooncakeTierConfig (with backend = "mooncake")
    master_address = "10.0.0.6:50051"
    capacity_bytes = 1099511627776
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping

from kvtier.core.layout import KVLayout
from kvtier.server.daemon import DaemonConfig
from kvtier.store import RemoteConfig, StoreConfig
from kvtier.tiers.disk import DiskTierConfig
from kvtier.tiers.host import HostTierConfig

_TOP = {"socket", "model", "model_dir", "policy", "write_through", "metrics_port", "tenant",
        "layout", "host", "disk", "remote"}
_REMOTE = {"backend", "write", "max_queued", "valkey", "mooncake"}


def read_toml(path: str) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config {path} is not valid TOML: {exc}") from exc


def _section(raw: Mapping[str, object], name: str, cls: type, allowed: set[str]) -> object:
    data = raw.get(name)
    if not isinstance(data, Mapping):
        raise ValueError(f"config section [{name}] is missing or not a table")
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"unknown key(s) in [{name}]: {sorted(unknown)}; allowed: {sorted(allowed)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"config section [{name}]: {exc}") from exc


def _remote(data: object) -> RemoteConfig:
    if not isinstance(data, Mapping):
        raise ValueError("config section [remote] is not a table")
    unknown = set(data) - _REMOTE
    if unknown:
        raise ValueError(f"unknown key(s) in [remote]: {sorted(unknown)}; allowed: {sorted(_REMOTE)}")
    backend = data.get("backend")
    if backend == "valkey":
        from kvtier.tiers.valkey import ValkeyTierConfig as cls
    elif backend == "mooncake":
        from kvtier.tiers.mooncake import MooncakeTierConfig as cls  # type: ignore[assignment]
    else:
        raise ValueError(f"[remote] backend must be 'valkey' or 'mooncake', got {backend!r}")
    sub = data.get(backend)
    if isinstance(sub, Mapping):  # TOML arrays are lists; the configs are frozen: tuples
        sub = {k: tuple(v) if isinstance(v, list) else v for k, v in sub.items()}
    section = _section({backend: sub}, backend, cls, set(cls.__dataclass_fields__))
    try:
        return RemoteConfig(section, write=str(data.get("write", "through")),
                            max_queued=int(data.get("max_queued", 256)))  # type: ignore[call-overload]
    except TypeError as exc:
        raise ValueError(f"config section [remote]: {exc}") from exc


def daemon_config(raw: Mapping[str, object]) -> DaemonConfig:
    """Build and validate a DaemonConfig from a parsed config (file merged with flags)."""
    unknown = set(raw) - _TOP
    if unknown:
        raise ValueError(f"unknown config key(s): {sorted(unknown)}; allowed: {sorted(_TOP)}")
    if not raw.get("socket"):
        raise ValueError("config needs 'socket' (the Unix socket path)")
    model = raw.get("model")
    layout: KVLayout
    if raw.get("model_dir"):
        from transformers import AutoConfig

        from kvtier.engines.hf import kv_layout_for, model_fingerprint

        model_dir = str(raw["model_dir"])
        lay = raw.get("layout") if isinstance(raw.get("layout"), Mapping) else {}
        layout = kv_layout_for(AutoConfig.from_pretrained(model_dir),
                               int(lay.get("chunk_tokens", 256)), str(lay.get("dtype", "float32")))  # type: ignore[union-attr]
        model = model or model_fingerprint(model_dir)
    else:
        layout = _section(raw, "layout", KVLayout,  # type: ignore[assignment]
                          {"num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens", "kv"})
    if not model:
        raise ValueError("config needs 'model' (a weights fingerprint) or 'model_dir'")
    host = _section(raw, "host", HostTierConfig, {"capacity_bytes", "pin_memory"})
    disk = None
    if raw.get("disk") is not None:
        disk = _section(raw, "disk", DiskTierConfig, {"path", "capacity_bytes", "fsync", "o_direct"})
    remote = _remote(raw["remote"]) if raw.get("remote") is not None else None
    store = StoreConfig(
        model=str(model), layout=layout, host=host, disk=disk, remote=remote,  # type: ignore[arg-type]
        policy=str(raw.get("policy", "lru")), tenant=str(raw.get("tenant", "")),
        write_through=bool(raw.get("write_through", False)),
    )
    port = raw.get("metrics_port")
    return DaemonConfig(socket_path=str(raw["socket"]), store=store,
                        metrics_port=None if port is None else int(port))  # type: ignore[call-overload]
