"""Imports point one way (core <- tiers <- store <- engines <- server/cli): checked on the
source, so that a shortcut across layers fails here rather than in a review."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src" / "kvtier"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py"))


def test_nothing_in_server_imports_an_engine():
    for path in modules("server"):
        bad = {m for m in imports_of(path) if m.startswith("kvtier.engines") or m == "transformers"}
        assert not bad, f"{path.name} imports {bad}"


def test_the_daemon_and_its_metrics_do_not_import_each_other():
    assert "kvtier.server.metrics" not in imports_of(SRC / "server" / "daemon.py")
    assert not {m for m in imports_of(SRC / "server" / "metrics.py") if m.startswith("kvtier.server.daemon")}


def test_core_imports_no_torch_no_tier_and_no_store():
    for path in modules("core"):
        bad = {m for m in imports_of(path)
               if m == "torch" or m.startswith(("kvtier.tiers", "kvtier.store", "kvtier.store.cache", "kvtier.server",
                                                "kvtier.engines"))}
        assert not bad, f"core/{path.name} imports {bad}"


def test_tiers_import_no_store_engine_or_server():
    for path in modules("tiers"):
        bad = {m for m in imports_of(path)
               if m.startswith(("kvtier.store", "kvtier.store.cache", "kvtier.server", "kvtier.engines"))}
        assert not bad, f"tiers/{path.name} imports {bad}"
