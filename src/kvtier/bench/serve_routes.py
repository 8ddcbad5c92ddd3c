"""Which instance of a fleet (:mod:`kvtier.bench.serve_fleet`) serves each turn, and which cores
each instance runs on."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ROUTES", "cpu_binds", "route_of"]


def _sticky(conversation: int, _turn: int, n: int) -> int:
    return conversation % n


def _round_robin(conversation: int, turn: int, n: int) -> int:
    return (conversation + turn) % n


ROUTES: dict[str, Callable[[int, int, int], int]] = {"sticky": _sticky, "round-robin": _round_robin}
"""Route name -> (conversation, turn, instances) -> the instance that turn goes to."""


def route_of(route: str, instances: int) -> Callable[[int, int], int]:
    """The chat client's router for ``instances`` servers (ValueError for an unknown route)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    pick = ROUTES[route]
    return lambda conversation, turn: pick(conversation, turn, instances)


def _cores(spec: str) -> list[int]:
    """``"0-1"``, ``"0,2-3"`` -> the core ids, in order (ValueError if malformed or repeated)."""
    cores: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"cpu_bind must be a core list like '0-1' or '0,2-3', got {spec!r}") from None
    if not cores or len(set(cores)) != len(cores):
        raise ValueError(f"cpu_bind must name distinct cores, got {spec!r}")
    return cores


def cpu_binds(spec: str, instances: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of each instance: the cores of ``spec`` split into
    ``instances`` equal runs, in order (cores left over by an uneven split go unused, so that
    every instance gets as many). ValueError if there are fewer cores than instances."""
    cores = _cores(spec)
    if len(cores) < instances:
        raise ValueError(f"--instances {instances} needs at least as many cores in --cpu-bind, "
                         f"got {spec!r} ({len(cores)})")
    k = len(cores) // instances
    return [",".join(map(str, cores[i * k:(i + 1) * k])) for i in range(instances)]
