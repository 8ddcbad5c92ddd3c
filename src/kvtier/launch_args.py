"""What :mod:`kvtier.launch` tells vLLM's server: the flags it owns (a user's copy is refused),
the ``--kv-transfer-config`` that plugs in kvtier's connector, and the timing proxy's wrapper
around a connector's config. Pure functions of their arguments: no process is started here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["CONNECTOR_MODULE", "OWNED_FLAGS", "PROFILE_MODULE", "flag_name", "has_flag",
           "kv_transfer_config", "names_flag", "profiled", "refuse_owned_flags"]

CONNECTOR_MODULE = "kvtier.engines.vllm"
OWNED_FLAGS = ("--kv-transfer-config", "--port", "--host", "--model")
"""vLLM flags the stack sets itself; a user's copy in the passthrough flags is refused."""
PROFILE_MODULE = "kvtier.bench.peers.connector_profile"
"""The timing proxy's module, as kvtier's own Python imports it."""


def flag_name(arg: str) -> str:
    """``--kv_transfer_config.kv_role=x`` -> ``--kv-transfer-config`` (vLLM's parser takes
    underscores for dashes, ``=`` values and dotted sub-keys of JSON options)."""
    return arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def names_flag(arg: str, name: str) -> bool:
    """Whether ``arg`` is vLLM's flag ``name`` in any spelling its parser takes, abbreviations
    included (argparse takes ``--por 9000`` for ``--port``; an ambiguous one it refuses)."""
    given = flag_name(arg)
    return arg.startswith("--") and len(given) > 2 and name.startswith(given)


def has_flag(args: Sequence[str], name: str) -> bool:
    """Whether ``args`` sets vLLM's flag ``name`` (``--served-model-name``), in any of the
    spellings vLLM's parser takes."""
    return any(names_flag(arg, name) for arg in args)


def refuse_owned_flags(args: Sequence[str]) -> None:
    """ValueError if ``args`` sets a flag the stack sets itself."""
    for arg in args:
        if names_flag(arg, "--kv-transfer-config"):
            raise ValueError("--kv-transfer-config is set by kvtier (it wires vLLM to the kvtier "
                             "daemon it starts); remove it from the vLLM flags")
        for name in OWNED_FLAGS:
            if names_flag(arg, name):
                given = flag_name(arg)
                spelled = name if given == name else f"{given} ({name})"
                raise ValueError(f"{spelled} is set by kvtier; use kvtier serve's own option instead "
                                 "of passing it to vLLM")


def kv_transfer_config(socket_path: str, chunk_tokens: int | None = None,
                       load_async: bool = False) -> dict[str, object]:
    """vLLM's ``--kv-transfer-config`` for the kvtier connector over the daemon at ``socket_path``."""
    extra: dict[str, object] = {"socket": socket_path}
    if chunk_tokens is not None:
        extra["chunk_tokens"] = chunk_tokens
    if load_async:
        extra["load_async"] = True
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def profiled(inner: Mapping[str, object], profile_dir: str,
             module: str = PROFILE_MODULE) -> dict[str, object]:
    """The ``--kv-transfer-config`` that wraps the connector ``inner`` configures in the timing
    proxy of ``module`` (:mod:`kvtier.bench.peers.connector_profile`)."""
    out: dict[str, object] = {"kv_connector": "ProfiledConnector", "kv_connector_module_path": module,
                              "kv_role": inner.get("kv_role", "kv_both"),
                              "kv_connector_extra_config": {"profile_dir": profile_dir,
                                                            "connector": dict(inner)}}
    if "kv_load_failure_policy" in inner:
        out["kv_load_failure_policy"] = inner["kv_load_failure_policy"]
    return out
