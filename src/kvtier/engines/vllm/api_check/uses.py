"""What kvtier's source takes from vLLM, read with :mod:`ast`: the names it imports, the calls
it makes of vLLM's functions and classes, the ``Class.NAME`` it reads, and its classes derived
from vLLM's (with the connector's hook each use lies in)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvtier.engines.vllm.api_check.shapes import ClassShape, class_of

KVTIER = Path(__file__).parents[3]
"""kvtier's package: the source read."""
CHECKED_CLASSES = "engines/"
"""Where kvtier's classes derived from vLLM's are compared with them: the connector's package
(the benchmarks' wrappers of other connectors are not)."""


@dataclass(frozen=True, slots=True)
class Use:
    """A name kvtier takes from vLLM: imported, called (``args``: positional arguments, -1: not
    a call) or read as ``Class.member``."""

    where: str
    module: str
    name: str
    hook: str | None = None
    """The method of kvtier's it lies in."""
    member: str | None = None
    args: int = -1
    keywords: tuple[str, ...] = ()
    star: bool = False
    """A call with ``*args`` or ``**kwargs``: not checked."""

    def __str__(self) -> str:
        what = f"{self.name}.{self.member}" if self.member else f"{self.name}(...)" if self.args >= 0 else self.name
        return f"{what} from {self.module} ({self.where})"


@dataclass(frozen=True)
class Subclass:
    """A class of kvtier's derived from a vLLM class."""

    where: str
    module: str
    base: str
    shape: ClassShape
    reads: frozenset[str]
    """The ``self.`` attributes it reads and never sets itself."""


class _Scan(ast.NodeVisitor):
    """What one kvtier file takes from vLLM."""

    def __init__(self, where: str, tree: ast.Module) -> None:
        self.where = where
        self.uses: list[Use] = []
        self.subclasses: list[Subclass] = []
        self.names = {a.asname or a.name: (n.module, a.name) for n in ast.walk(tree)
                      if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "vllm"
                      for a in n.names}
        self._hook: str | None = None
        self._in_class = False
        self.visit(tree)

    def _use(self, node: ast.AST, module: str, name: str, **kw: object) -> None:
        self.uses.append(Use(f"{self.where}:{node.lineno}", module, name, self._hook, **kw))  # type: ignore[attr-defined,arg-type]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in self.names:
                module, name = self.names[base.id]
                shape = class_of(node)
                sets = shape.attrs | {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                                      for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                                      if isinstance(t, ast.Attribute)}
                reads = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                         and n.value.id in ("self", "cls") and isinstance(n.ctx, ast.Load)}
                own = sets | set(shape.methods) | shape.members
                self.subclasses.append(Subclass(f"{self.where}:{node.lineno}", module, name, shape,
                                                frozenset(reads - own)))
        was, self._in_class = self._in_class, True
        self.generic_visit(node)
        self._in_class = was

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        was = self._hook
        if self._in_class and self._hook is None:
            self._hook = node.name
        in_class, self._in_class = self._in_class, False
        self.generic_visit(node)
        self._hook, self._in_class = was, in_class

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.level and (node.module or "").split(".")[0] == "vllm":
            for a in node.names:
                self._use(node, node.module, a.name)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith("vllm."):
                self._use(node, a.name, "")

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in self.names:
            module, name = self.names[node.func.id]
            star = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
            self._use(node, module, name, args=len(node.args), keywords=tuple(k.arg for k in node.keywords if k.arg),
                      star=star)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.names:
            module, name = self.names[node.value.id]
            self._use(node, module, name, member=node.attr)
        self.generic_visit(node)


@cache
def kvtier_uses(root: Path = KVTIER) -> tuple[tuple[Use, ...], tuple[Subclass, ...]]:
    """Everything kvtier's source (``root``) takes from vLLM."""
    uses: list[Use] = []
    subclasses: list[Subclass] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "vllm" not in text:
            continue
        where = str(path.relative_to(root))
        scan = _Scan(where, ast.parse(text))
        uses += scan.uses
        subclasses += scan.subclasses if where.startswith(CHECKED_CLASSES) else []
    return tuple(uses), tuple(subclasses)
