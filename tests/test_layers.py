"""The house rules, checked on the source so that a shortcut fails here rather than in a review.

Imports point one way: core <- tiers <- store <- server and engines <- bench <- cli. No import
cycle of any kind (typing-only and function-local imports count). No module past 400 lines. A
daemon's client depends on the arena, the protocol and the result types, not on a tier."""

from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "kvtier"
MAX_LINES = 400
ROOT_MODULES = {"__init__", "demo", "errors", "launch", "launch_args", "model_id", "typed", "vector"}
"""What stays at the package root: what users import, and the commands' own entry points."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in SRC.rglob("*.py")}


@cache
def imports_of(path: Path) -> frozenset[str]:
    """Every module the file names in an import, wherever the import stands."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module_name(path).split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in all_modules())
    return frozenset(names)


def kvtier_imports(name: str) -> set[str]:
    return {m for m in imports_of(all_modules()[name]) if m in all_modules() and m != name}


def modules(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py"))


def assert_imports_none_of(package: str, banned: tuple[str, ...], *, torch: bool = False) -> None:
    for path in modules(package):
        bad = {m for m in imports_of(path) if m.startswith(banned) or (torch and m.split(".")[0] == "torch")}
        assert not bad, f"{package}/{path.relative_to(SRC / package)} imports {sorted(bad)}"


def test_core_imports_no_torch_and_nothing_above_it():
    assert_imports_none_of("core", ("kvtier.tiers", "kvtier.store", "kvtier.server", "kvtier.engines",
                                    "kvtier.bench", "kvtier.cli"), torch=True)


def test_tiers_import_nothing_above_them():
    assert_imports_none_of("tiers", ("kvtier.store", "kvtier.server", "kvtier.engines", "kvtier.bench", "kvtier.cli"))


def test_the_store_imports_no_daemon_engine_benchmark_or_command():
    assert_imports_none_of("store", ("kvtier.server", "kvtier.engines", "kvtier.bench", "kvtier.cli"))


def test_the_daemon_imports_no_engine_and_no_transformers():
    assert_imports_none_of("server", ("kvtier.engines", "kvtier.bench", "kvtier.cli", "transformers", "vllm"))


def test_engines_import_no_benchmark_or_command():
    assert_imports_none_of("engines", ("kvtier.bench", "kvtier.cli"))


def test_benchmarks_import_no_command():
    assert_imports_none_of("bench", ("kvtier.cli",))


def test_the_daemon_and_its_metrics_do_not_import_each_other():
    assert "kvtier.server.metrics" not in imports_of(SRC / "server" / "daemon.py")
    assert not {m for m in imports_of(SRC / "server" / "metrics.py") if m.startswith("kvtier.server.daemon")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_no_import_cycle_of_any_kind():
    graph = {name: kvtier_imports(name) for name in all_modules()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_the_cycle_finder_finds_a_cycle():
    assert set(find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) or ()) == {"a", "b", "c"}
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_passes_400_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules past {MAX_LINES} lines: {long}"


def test_the_package_root_holds_only_what_users_import():
    assert {p.stem for p in SRC.glob("*.py")} <= ROOT_MODULES


def test_a_daemon_client_depends_on_the_arena_and_the_protocol_not_on_a_tier():
    allowed_low = {"kvtier.tiers.arena", "kvtier.store.results", "kvtier.store.packing"}
    for client in ("kvtier.server.client", "kvtier.server.connection"):
        seen = closure(client)
        low = {m for m in seen if m.startswith(("kvtier.tiers", "kvtier.store"))}
        assert low <= allowed_low, f"{client} depends on {sorted(low - allowed_low)}"
        assert not {m for m in seen if m.startswith(("kvtier.engines", "kvtier.server.daemon"))}


def closure(name: str) -> set[str]:
    """Every kvtier module ``name`` reaches through its imports."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in kvtier_imports(todo.pop()) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_nothing_the_daemon_reaches_is_an_engine_even_through_a_root_module():
    for path in modules("server"):
        bad = {m for m in closure(module_name(path)) if m.startswith(("kvtier.engines", "kvtier.bench", "kvtier.cli"))}
        assert not bad, f"{module_name(path)} reaches {sorted(bad)}"


def modules_loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``: what the rules above claim,
    checked as Python really runs it (package __init__ files included)."""
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return set(out.stdout.split())


def test_importing_a_part_of_kvtier_runs_only_that_part():
    client = modules_loaded_by("import kvtier.server.client")
    assert {m for m in client if m.startswith(("kvtier.tiers.", "kvtier.store."))} == {
        "kvtier.tiers.arena", "kvtier.store.packing", "kvtier.store.results"}
    daemon = modules_loaded_by("import kvtier.server.daemon, kvtier.server.http")
    assert not {m for m in daemon if m.startswith("kvtier.engines") or m.split(".")[0] in ("transformers", "vllm")}
    assert "torch" not in modules_loaded_by("import kvtier.core.keys, kvtier.core.policy, kvtier.core.placement")
    everything = modules_loaded_by("from kvtier import *; import kvtier.store as s; s.KVStore")
    assert {"kvtier.store.facade", "kvtier.tiers.disk_config", "kvtier.tiers.host_config"} <= everything


def test_the_roots_names_are_all_there():
    import kvtier
    import kvtier.store

    for package in (kvtier, kvtier.store):
        assert sorted(package.__all__) == sorted(package._HOME)
        for name in package.__all__:
            assert getattr(package, name).__name__ == name
