"""The shape of a Python API -- methods with their parameters, what a class's ``__init__`` sets,
the names a class or module binds -- read two ways that must agree: from source with :mod:`ast`
(a vLLM release's wheel, never imported) and from live objects with :mod:`inspect` (the vLLM
installed here). :mod:`.checks` compares kvtier's connector with vLLM's through these."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    kind: str
    """One of :data:`KINDS`' values."""
    default: bool
    """Whether it has a default (a caller may leave it out)."""

    def __str__(self) -> str:
        mark = {"*args": "*", "**kwargs": "**"}.get(self.kind, "")
        kind = f" ({self.kind})" if self.kind in ("positional-only", "keyword-only") else ""
        return f"{mark}{self.name}{'=...' if self.default else ''}{kind}"


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    kind: str
    """``method``, ``classmethod``, ``staticmethod`` or ``property``."""
    params: tuple[Param, ...]
    """Without ``self`` or ``cls``."""
    abstract: bool = False

    def __str__(self) -> str:
        if self.kind == "property":
            return f"property {self.name}"
        prefix = "" if self.kind == "method" else f"{self.kind} "
        return f"{prefix}{self.name}({', '.join(map(str, self.params))})"


@dataclass(frozen=True)
class ClassShape:
    name: str
    methods: dict[str, Method]
    """Those the class body defines (not inherited)."""
    attrs: frozenset[str]
    """What its ``__init__`` assigns on ``self``."""
    members: frozenset[str]
    """Names its body binds outside methods (enum members, fields, class attributes)."""


# -- from source ---------------------------------------------------------------------------------
def params_of(args: ast.arguments, *, bound: bool) -> tuple[Param, ...]:
    """The parameters of a ``def``; ``bound``: drop the first (``self`` or ``cls``)."""
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    out = [Param(a.arg, "positional-only" if i < len(args.posonlyargs) else "positional", i >= first_default)
           for i, a in enumerate(positional)]
    if args.vararg is not None:
        out.append(Param(args.vararg.arg, "*args", False))
    out += [Param(a.arg, "keyword-only", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg is not None:
        out.append(Param(args.kwarg.arg, "**kwargs", False))
    return tuple(out[1:] if bound and out and out[0].kind in ("positional", "positional-only") else out)


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else "")
    return names


def method_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method:
    decorators = _decorators(fn)
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
    if "cached_property" in decorators:
        kind = "property"
    params = () if kind == "property" else params_of(fn.args, bound=kind != "staticmethod")
    return Method(fn.name, kind, params, abstract="abstractmethod" in decorators)


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def class_of(node: ast.ClassDef) -> ClassShape:
    methods: dict[str, Method] = {}
    members: set[str] = set()
    attrs: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            m = method_of(item)
            if item.name in methods and m.kind == "method" and methods[item.name].kind == "property":
                continue  # a property's setter
            methods[item.name] = m
            if item.name == "__init__":
                attrs |= {t.attr for n in ast.walk(item) for t in _assigned(n)
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        else:
            members.update(_targets(item))
    return ClassShape(node.name, methods, frozenset(attrs), frozenset(members))


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def fields_of(tree: ast.Module, node: ast.ClassDef) -> tuple[Param, ...]:
    """A dataclass-like class's constructor (a ``msgspec.Struct``, a dataclass): its annotated
    fields, those of its bases in the same module first."""
    out: list[Param] = []
    for base in node.bases:
        parent = find_class(tree, base.id) if isinstance(base, ast.Name) else None
        if parent is not None:
            out += fields_of(tree, parent)
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and "ClassVar" not in ast.unparse(item.annotation):
            out = [p for p in out if p.name != item.target.id]
            out.append(Param(item.target.id, "positional", item.value is not None))
    return tuple(out)


def find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in _top(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def find_function(tree: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    return next((n for n in _top(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
                None)


def _top(tree: ast.Module) -> list[ast.stmt]:
    """A module's top-level statements, those under ``if`` and ``try`` included."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        out.append(node)
        if isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def bindings(tree: ast.Module) -> dict[str, ast.stmt]:
    """Every name a module binds at its top level -> the statement that binds it."""
    out: dict[str, ast.stmt] = {}
    for node in _top(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = node
        else:
            for name in _targets(node):
                out[name] = node
    return out


# -- from live objects ---------------------------------------------------------------------------
def live_params(obj: object, *, bound: bool = False) -> tuple[Param, ...]:
    sig = inspect.signature(obj)  # type: ignore[arg-type]
    params = [Param(p.name, KINDS[p.kind], p.default is not inspect.Parameter.empty) for p in sig.parameters.values()]
    return tuple(params[1:] if bound else params)


def live_method(cls: type, name: str) -> Method:
    raw = inspect.getattr_static(cls, name)
    abstract = bool(getattr(getattr(raw, "__func__", raw), "__isabstractmethod__", False))
    if isinstance(raw, property) or type(raw).__name__ == "cached_property":
        return Method(name, "property", (), abstract)
    if isinstance(raw, classmethod):
        return Method(name, "classmethod", live_params(raw.__func__, bound=True), abstract)
    if isinstance(raw, staticmethod):
        return Method(name, "staticmethod", live_params(raw.__func__), abstract)
    return Method(name, "method", live_params(raw, bound=True), abstract)


def live_class(cls: type) -> ClassShape:
    """What ``cls`` itself defines (its ``__dict__``); ``attrs`` are left empty (they are
    known only once an ``__init__`` has run)."""
    methods = {name: live_method(cls, name) for name, v in vars(cls).items()
               if callable(v) or isinstance(v, (classmethod, staticmethod, property))
               or type(v).__name__ == "cached_property"}
    members = {name for name in vars(cls) if name not in methods and not name.startswith("__")}
    if hasattr(cls, "__members__"):  # an enum
        members |= set(cls.__members__)
    return ClassShape(cls.__name__, methods, frozenset(), frozenset(members))
