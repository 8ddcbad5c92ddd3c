"""What :mod:`kvtier.launch` tells vLLM's server and reads back from a child's log: the flags it
owns (a user's copy is refused), the ``--kv-transfer-config`` that plugs in kvtier's connector,
the timing proxy's wrapper around a connector's config, the KV cache a CPU gets beside kvtier's
arena, and the lines of a log that say why a child exited. Pure functions of their arguments: no
process is started and nothing is read here."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "CONNECTOR_MODULE",
    "CPU_KV_MAX",
    "CPU_KV_MIN",
    "HINT_MIDDLEWARE",
    "KV_MEMORY_FLAGS",
    "OWNED_FLAGS",
    "PROFILE_MODULE",
    "VLLM_BASE_BYTES",
    "KVCachePlan",
    "cause_lines",
    "cpu_kv_cache",
    "flag_name",
    "has_flag",
    "kv_memory_set_by",
    "kv_transfer_config",
    "names_flag",
    "profiled",
    "refuse_owned_flags",
]

CONNECTOR_MODULE = "kvtier.engines.vllm"
HINT_MIDDLEWARE = "kvtier.engines.vllm.hint_check.HintCheck"
"""vLLM's ``--middleware`` that answers a malformed session hint with HTTP 400
(:mod:`kvtier.engines.vllm.hint_check`)."""
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


# -- vLLM's KV cache on a CPU, beside kvtier's arena --------------------------------------------

KV_MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--device-memory-utilization")
"""vLLM's flags that size its KV cache (on a CPU, in host memory): with one of them, or
``--config`` (whose file may set them), or ``VLLM_CPU_KVCACHE_SPACE``, kvtier sizes nothing."""
CPU_KV_MAX = 4 << 30
"""The most kvtier serve gives vLLM's KV cache on a CPU: what vLLM's CPU backend took itself
before 0.10 when ``VLLM_CPU_KVCACHE_SPACE`` was unset."""
CPU_KV_MIN = 1 << 30
"""The least: below it, kvtier serve refuses to start and says what to change."""
VLLM_BASE_BYTES = 2 << 30
"""vLLM's three processes (API server, engine core, worker) on a CPU before weights and KV
cache: 1.7 GiB measured with vllm-cpu 0.32 on a 2-core machine."""


def kv_memory_set_by(args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The user's setting that sizes vLLM's KV memory -- a flag of :data:`KV_MEMORY_FLAGS` or
    ``--config`` as written in ``args`` (any spelling vLLM's parser takes), or
    ``VLLM_CPU_KVCACHE_SPACE`` set in ``env`` (vLLM's CPU backend takes it over both flags) --
    or None."""
    if env.get("VLLM_CPU_KVCACHE_SPACE"):
        return "VLLM_CPU_KVCACHE_SPACE"
    return next((arg for arg in args for name in (*KV_MEMORY_FLAGS, "--config") if names_flag(arg, name)), None)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache kvtier serve gives vLLM on a CPU, and the memory it was sized from."""

    kv_bytes: int
    available_bytes: int
    arena_bytes: int
    vllm_bytes: int

    @property
    def args(self) -> tuple[str, str]:
        """vLLM's flags for it (an explicit size also skips vLLM's own sizing and its check)."""
        return ("--kv-cache-memory-bytes", str(self.kv_bytes))

    def describe(self) -> str:
        return (f"vLLM runs on the CPU: its KV cache gets {_gib(self.kv_bytes)} ({' '.join(self.args)}) of "
                f"{_gib(self.available_bytes)} free, less the {_gib(self.arena_bytes)} arena and about "
                f"{_gib(self.vllm_bytes)} for vLLM itself; pass --kv-cache-memory-bytes or "
                "--gpu-memory-utilization after -- to choose")


def cpu_kv_cache(available_bytes: int, arena_bytes: int, weights_bytes: int) -> KVCachePlan:
    """The KV cache for vLLM on a CPU where ``available_bytes`` are free before kvtier's arena of
    ``arena_bytes`` is made: half of what the arena and vLLM itself (:data:`VLLM_BASE_BYTES` and
    twice the weight files, for a dtype wider than the files') leave, at most
    :data:`CPU_KV_MAX`, in whole MiB. vLLM's own default on a CPU reserves 92% of *all* memory
    for itself and refuses to start when that much is not free, which an arena guarantees.

    ValueError when less than :data:`CPU_KV_MIN` fits, naming the flags that would fit."""
    if min(available_bytes, arena_bytes, weights_bytes) < 0:
        raise ValueError("memory sizes must not be negative")
    vllm_bytes = VLLM_BASE_BYTES + 2 * weights_bytes
    half = max(0, available_bytes - arena_bytes - vllm_bytes) // 2
    kv_bytes = min(CPU_KV_MAX, half) >> 20 << 20
    if kv_bytes >= CPU_KV_MIN:
        return KVCachePlan(kv_bytes, available_bytes, arena_bytes, vllm_bytes)
    fits = (available_bytes - vllm_bytes - 2 * CPU_KV_MIN) >> 26 << 6  # the arena that would: MiB, whole 64 MiB
    fix = f"Add --host-bytes {fits}MiB (a smaller arena), or size" if fits >= 64 else "Size"
    raise ValueError(
        f"vLLM runs on the CPU, and its KV cache would not fit in host memory beside kvtier's: "
        f"{_gib(available_bytes)} is free, the arena takes {_gib(arena_bytes)} (--host-bytes) and vLLM "
        f"about {_gib(vllm_bytes)} before its KV cache, which kvtier serve gives at least "
        f"{_gib(CPU_KV_MIN)}. {fix} vLLM's KV cache yourself after `--`, e.g. "
        "`-- --kv-cache-memory-bytes 512M`; or free memory.")


# -- why a child exited -------------------------------------------------------------------------

_RECORD = re.compile(
    r"^(?P<stream>\([^()]*pid=\d+\) )?"  # vLLM's prefix for a line of one of its processes
    r"(?:(?P<vllm>[A-Z]+) \d\d-\d\d [\d:]+ \[[^]]*\] "  # vLLM's log format
    r"|\d{4}-\d\d-\d\d [\d:,]+ \S+ (?P<kvtier>[A-Z]+) )?"  # kvtier's (the daemon's)
    r"(?P<message>.*)$")
_EXCEPTION = re.compile(r"[A-Za-z_][\w.]*(: .*)?$")
"""A traceback's last line: the exception's (dotted) class, then its message."""
_ERROR = re.compile(r"Error: |\S+: error: ")
"""click's and argparse's line for a command that refused to run."""
MAX_CAUSES = 12


def cause_lines(log: str) -> list[str]:
    """The lines of a child's ``log`` that say why it exited, in order, each once: the last line
    of every traceback (``ValueError: ...``; with vLLM's per-process prefix, several processes'
    tracebacks interleaved), every ``ERROR``/``CRITICAL`` record that is not part of one, and
    click's or argparse's ``Error:`` line. At most :data:`MAX_CAUSES`, the first ones: the root
    cause comes before what it brought down."""
    in_traceback: set[str] = set()
    """The streams (vLLM's process prefix; "" for lines without one) inside a traceback."""
    found: dict[str, str] = {}
    for line in log.splitlines():
        m = _RECORD.match(line)
        assert m is not None  # (every part of the pattern but the message is optional)
        stream, message = m["stream"] or "", m["message"]
        if message.startswith("Traceback (most recent call last)"):
            in_traceback.add(stream)
        elif stream in in_traceback:
            if message[:1].isspace() or not _EXCEPTION.match(message):
                continue  # a frame, its source line, or a line of another process in between
            in_traceback.discard(stream)
            found.setdefault(message, line.strip())
        elif (m["vllm"] or m["kvtier"]) in ("ERROR", "CRITICAL") or _ERROR.match(message):
            found.setdefault(message, line.strip())
    return list(found.values())[:MAX_CAUSES]
