"""When an override fits the method it overrides, and a call the function it calls: the rules
:mod:`.checks` applies, to shapes read from source and from live objects alike."""

from __future__ import annotations

import ast
import re

from kvtier.engines.vllm.api_check.release import Found
from kvtier.engines.vllm.api_check.shapes import (
    ClassShape,
    Method,
    Param,
    fields_of,
    find_class,
    params_of,
)
from kvtier.engines.vllm.api_check.uses import Use

CONNECTOR = "KVTierConnector"
HOOKS_SINCE = {
    "supports_sleep_mode": "0.33", "unregister_kv_caches": "0.33", "restore_kv_caches": "0.33",
    "kv_cache_access": "0.34", "may_load_async": "0.34", "supports_lookahead_block_hashes": "0.34",
}
"""The connector's hooks that vLLM added after the oldest supported release, by first release."""
KVTIER_ONLY = {"profile_counters"}
"""The connector's public methods that are kvtier's own (vLLM never calls them)."""


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def compare(ours: ClassShape, base: ClassShape, version: str, reads: frozenset[str] = frozenset(),
            base_sets: frozenset[str] = frozenset()) -> list[str]:
    """Why kvtier's class ``ours`` does not fit vLLM's ``base`` (of release ``version``)."""
    out: list[str] = []
    connector = ours.name == CONNECTOR
    for name, mine in sorted(ours.methods.items()):
        if name.startswith("_") and name != "__init__":
            continue
        theirs = base.methods.get(name)
        since = HOOKS_SINCE.get(name) if connector else None
        if theirs is None:
            if since is not None and version_tuple(version) >= version_tuple(since):
                out.append(f"{ours.name}.{name}: a hook of vLLM {since} and later, missing from {base.name}")
            elif connector and since is None and name not in KVTIER_ONLY and name != "__init__":
                out.append(f"{ours.name}.{name}: not a method of {base.name} (renamed or removed in vLLM?); "
                           "vLLM never calls it")
            continue
        if since is not None and version_tuple(version) < version_tuple(since):
            out.append(f"{ours.name}.{name}: {base.name} has it already, before {since} (HOOKS_SINCE is wrong)")
        problem = mismatch(mine, theirs)
        if problem:
            out.append(f"{ours.name}.{name}: {problem}: kvtier's {mine}, vLLM's {theirs}")
    for name, theirs in sorted(base.methods.items()):
        if theirs.abstract and (name not in ours.methods or ours.methods[name].abstract):
            out.append(f"{ours.name}: does not implement {base.name}.{name}, abstract")
    known = base.attrs | base.members | set(base.methods) | base_sets
    out += [f"{ours.name}: reads self.{a}, which {base.name} does not set" for a in sorted(reads - known)]
    return out


def mismatch(mine: Method, theirs: Method) -> str | None:
    """Why an override does not fit the method it overrides (None: it fits)."""
    if mine.kind != theirs.kind:
        return f"a {mine.kind}, vLLM's is a {theirs.kind}"
    if {"*args", "**kwargs"} <= {p.kind for p in mine.params} and len(mine.params) == 2:
        return None  # a pure forwarder takes any call
    for i, want in enumerate(theirs.params):
        got = mine.params[i] if i < len(mine.params) else None
        if got is None:
            return f"lacks parameter {want.name}"
        if (got.name, got.kind) != (want.name, want.kind):
            return f"parameter {i + 1} is {got}, vLLM's is {want}"
        if want.default and not got.default:
            return f"parameter {want.name} has no default, vLLM's has one (vLLM may leave it out)"
    extra = [p for p in mine.params[len(theirs.params):] if not (p.default or p.kind in ("*args", "**kwargs"))]
    return f"requires parameter {extra[0].name}, which vLLM never passes" if extra else None


def binds(params: tuple[Param, ...], use: Use) -> str | None:
    """Why kvtier's call ``use`` does not bind to ``params`` (None: it does)."""
    positional = [p for p in params if p.kind in ("positional-only", "positional")]
    var_pos = any(p.kind == "*args" for p in params)
    var_kw = any(p.kind == "**kwargs" for p in params)
    if use.args > len(positional) and not var_pos:
        return f"takes {len(positional)} positional arguments, kvtier passes {use.args}"
    given = {p.name for p in positional[: use.args]}
    by_name = {p.name: p for p in params if p.kind in ("positional", "keyword-only")}
    for k in use.keywords:
        if k not in by_name and not var_kw:
            return f"has no parameter {k}"
        if k in given:
            return f"gets {k} twice"
        given.add(k)
    missing = [p.name for p in params if p.kind in ("positional-only", "positional", "keyword-only")
               and not p.default and p.name not in given]
    return f"requires {', '.join(missing)}, which kvtier does not pass" if missing else None


def signature(found: Found) -> tuple[Param, ...] | None:
    node = found.node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return params_of(node.args, bound=False)
    if isinstance(node, ast.ClassDef):
        cls: ast.ClassDef | None = node
        while cls is not None:
            init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is not None:
                return params_of(init.args, bound=True)
            parent = cls.bases[0] if cls.bases else None
            cls = find_class(found.tree, parent.id) if isinstance(parent, ast.Name) else None
        return fields_of(found.tree, node)
    return None
