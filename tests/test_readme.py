"""The README and the docs, run or checked as written.

- Every ```python block of README.md and docs/*.md runs, in a temporary directory, with the
  suite's kvtier home (the embedded tiny model already built): a reader copies it, so it
  imports and builds what it uses (a small layout and config, the tiny model), and the whole
  file takes seconds.
- Every ``kvtier ...`` command in README.md, CONTRIBUTING.md and docs/*.md -- lines of
  ```bash/sh/shell/console blocks, and inline code spans that start with ``kvtier `` -- is parsed
  by the real click CLI (:data:`kvtier.cli.main`): the subcommand exists, every flag exists and
  takes its value, values convert (choices, sizes, numbers), required arguments are there, and
  a model (``kvtier serve MODEL``, ``--model``) is one of kvtier's model names, a hub id, a
  directory or a placeholder. Nothing runs. A synopsis (a line with ``[--flag]``, ``a|b``
  alternatives, ``...`` or ``--flag PLACEHOLDER``) is checked the same way, except for what is a
  placeholder (``N``, ``MODEL_DIR``, ``<path>``, ``...``); each of ``a|b`` is a value; a choice
  is never a placeholder (write ``none|int8``, not ``CODEC``). ``make X`` names a Makefile target.
- Every ```toml block that configures the daemon is read by :func:`kvtier.server.config.daemon_config`
  (with the socket moved into a temporary directory); a fragment (no ``[host]``) is read merged
  over the previous whole config of its page, as the page says to use it.
- ``kvtier.*`` names in code (``from kvtier.x import y``, a span that is a dotted name, a quoted
  module path) resolve as Python resolves them: the module imported, then an attribute at a
  time (re-exports, methods of base classes, instances' fields). A module whose import would
  import vLLM (seconds) or a package not installed here is read from its source instead,
  following re-exports and base classes. ``src/``, ``tests/`` and ``scripts/`` paths exist.
- Every relative link points to a file that exists, and a ``#fragment`` to a heading in it.

A block that needs a server, a GPU, a scratch environment or a long run is marked in the
markdown by an HTML comment on the line before it, ``<!-- needs: server -->``: a python block so
marked is compiled (whole Python) and skipped with that reason; the commands of a shell block so marked are still parsed
(parsing starts nothing). Abridged source excerpts and signatures are ```text, not ```python.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import re
import shlex
import textwrap
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src" / "kvtier"
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
NEEDS = re.compile(r"<!--\s*needs:\s*(?P<what>[^>]*?)\s*-->")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str
    needs: str | None
    """What the block needs that the test does not have (``server``, ...), from its marker."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a markdown page, with the ``needs`` marker before each."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group("fence"), i
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NEEDS.search(prev)
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].lstrip().startswith(fence):
            body.append(lines[i])
            i += 1
        found.append(Block(page, start + 1, m.group("lang").lower(), "\n".join(body) + "\n",
                           marker.group("what") if marker else None))
        i += 1
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks (for inline spans and links)."""
    out, inside, fence = [], False, ""
    for line in page.read_text().splitlines():
        m = FENCE.match(line)
        if not inside and m:
            inside, fence = True, m.group("fence")
            out.append("")
        elif inside and line.lstrip().startswith(fence):
            inside = False
            out.append("")
        else:
            out.append("" if inside else line)
    return "\n".join(out)


def spans(page: Path) -> list[str]:
    """Inline code spans of the prose (a span may wrap lines), whitespace normalized."""
    return [" ".join(s.split()) for s in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose(page))]


# -- python blocks ------------------------------------------------------------------------------

PYTHON_BLOCKS = [b for page in PAGES for b in blocks(page) if b.lang in ("python", "py")]


def test_the_readme_has_a_runnable_python_example():
    assert [b for b in PYTHON_BLOCKS if b.page == README and b.needs is None]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           tiny_model_dir: Path):
    """Every ```python block of README.md and docs/ runs as written (a reader copies it); one
    marked as needing more is at least whole Python."""
    code = compile(block.text, block.where, "exec")
    if block.needs is not None:
        pytest.skip(f"{block.where} needs {block.needs}: compiled, not run")
    # kvtier's home is the suite's, where the embedded tiny model is already built (never ~/.cache)
    monkeypatch.setenv("KVTIER_HOME", str(tiny_model_dir.parents[1]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    exec(code, {"__name__": "__readme__"})  # noqa: S102 - running the docs' example is the test


MARKED = [b for page in PAGES for b in blocks(page) if b.needs is not None and b.lang not in ("python", "py")]


@pytest.mark.parametrize("block", MARKED, ids=lambda b: b.where)
def test_blocks_marked_as_needing_more_are_not_run(block: Block):
    """Listed by ``pytest -rs``: what the docs show that this suite does not run, and why. Their
    ``kvtier`` commands are still parsed (test_every_kvtier_command_parses)."""
    pytest.skip(f"{block.where} needs {block.needs}: not run; its kvtier commands are parsed")


# -- commands -----------------------------------------------------------------------------------


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """A shell block's commands: lines joined across a trailing backslash and across a quoted
    string that spans lines; a line that starts with white space and ``[`` continues a synopsis
    line above it."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for n, line in enumerate(text.splitlines()):
        if pending is not None:
            start, head = pending
            line, n = f"{head}\n{line}", start
        elif out and re.match(r"\s+\[", line):
            out[-1] = (out[-1][0], f"{out[-1][1]} {line.strip()}")
            continue
        pending = None
        if line.rstrip().endswith("\\"):
            pending = (n, line.rstrip()[:-1])
            continue
        try:
            shlex.split(line, comments=True)
        except ValueError:  # a quotation still open: the next line continues it
            pending = (n, line)
            continue
        if line.strip():
            out.append((n, re.sub(r"^\s*\$\s+", "", line)))
    if pending is not None:
        out.append(pending)
    yield from out


def shell_commands(page: Path) -> Iterator[tuple[str, str, bool]]:
    """(where, command, from prose) for every command line of the page's shell blocks, and for
    every inline span that starts with ``kvtier `` or ``make ``."""
    for b in blocks(page):
        if b.lang in SHELL:
            for n, line in logical_lines(b.text):
                yield f"{b.where}+{n}", line, False
    for text in spans(page):
        if text.startswith(("kvtier ", "make ")):
            yield f"{page.relative_to(ROOT)} `{text}`", text, True


def split_commands(line: str) -> list[list[str]]:
    """A shell line's simple commands (split at ``;``, ``&&``, ``|``), comments dropped, each
    without leading ``time``, ``VAR=value`` and a ``.venv/bin/`` prefix."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in (";", "&&", "||", "|", "&"):
            out.append([])
        else:
            out[-1].append(token)
    cleaned = []
    for argv in out:
        while argv and (argv[0] == "time" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0])):
            argv = argv[1:]
        if argv:
            argv[0] = re.sub(r"^(\./)?\.venv/bin/", "", argv[0])
            cleaned.append(argv)
    return cleaned


SYNOPSIS = re.compile(r"\[-|\.\.\.|\w\|\w|(?<=\s)--?[\w-]+\s+[A-Z][A-Z0-9_]*(?=\s|$)")
"""``[--flag]``, ``...``, ``a|b``, or a flag followed by a placeholder (``--dram-blocks N``)."""


def synopsis_argv(line: str) -> list[str] | None:
    """A synopsis line's words (its comment dropped), or None for a line to run as written."""
    line = re.split(r"\s#\s", line)[0]
    return line.split() if SYNOPSIS.search(line) else None


def resolve(argv: list[str]) -> tuple[click.Command, list[str], list[str]]:
    """The click command ``argv`` names, the names walked, and the arguments left for it."""
    from kvtier.cli import main

    cmd: click.Command = main
    names = ["kvtier"]
    rest = argv[1:]
    while isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
        sub = cmd.commands.get(rest[0])
        if sub is None:
            raise click.UsageError(f"no command {' '.join(names)} {rest[0]!r}; "
                                   f"there are {sorted(cmd.commands)}")
        cmd, names, rest = sub, [*names, rest[0]], rest[1:]
    return cmd, names, rest


def option_names(cmd: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.hidden:
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def lenient(cmd: click.Command) -> click.Command:
    """``cmd`` with its path parameters as plain strings: a documented path need not exist here."""
    out = copy.copy(cmd)
    out.params = []
    for p in cmd.params:
        if isinstance(p.type, (click.Path, click.File)):
            p = copy.copy(p)
            p.type = click.STRING
        out.params.append(p)
    return out


PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\.\w+)?|<[^<>]+>|.*\.\.\..*")
"""A value the reader fills in: ``N``, ``MODEL_DIR``, ``FILE.png``, ``<path>``, ``...``,
``llama-2-13b,...``."""
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
"""``org/name[@revision]``, a hub id's shape."""


@cache
def kvtier_model_names() -> frozenset[str]:
    """kvtier's own model names (``smollm2``, ``tiny``, ...): ``kvtier_models()``, imported from
    the module under src/kvtier that defines it, wherever that is now."""
    for path in sorted(SRC.rglob("*.py")):
        if re.search(r"^def kvtier_models\(", path.read_text(), re.MULTILINE):
            parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
            module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
            return frozenset(module.kvtier_models())
    raise LookupError("no module under src/kvtier defines kvtier_models()")


def model_problem(value: str) -> str | None:
    """Why ``value`` is no model a command takes (``kvtier serve MODEL``, ``--model``): not a
    placeholder, not one of kvtier's model names, not a hub id, not a directory path."""
    if (PLACEHOLDER.fullmatch(value) or value in kvtier_model_names() or HUB_ID.fullmatch(value)
            or value.startswith(("/", "./", "../", "~"))):
        return None
    return (f"{value!r} is none of kvtier's models ({', '.join(sorted(kvtier_model_names()))}), "
            f"a hub id (org/name) or a directory")


def check_value(cmd: click.Command, names: list[str], param: click.Parameter, value: str) -> None:
    """``value`` as written for ``param``, each of its ``a|b`` alternatives: converted by its
    type (sizes, numbers, choices) and its callback; a model, named. A placeholder is not
    checked, but for a choice (``--disk-codec CODEC`` would hide a typo: write ``none|int8``)."""
    loose = next(p for p in lenient(cmd).params if p.name == param.name)
    label = f"{' '.join(names)} {param.opts[0] if isinstance(param, click.Option) else param.human_readable_name}"
    for alt in value.split("|"):
        if alt == "..." or (PLACEHOLDER.fullmatch(alt) and not isinstance(param.type, click.Choice)):
            continue
        if param.name == "model" and (problem := model_problem(alt)):
            raise click.UsageError(f"{label}: {problem}")
        ctx = click.Context(lenient(cmd), info_name=" ".join(names))
        try:
            loose.process_value(ctx, (alt,) if loose.multiple or loose.nargs != 1 else alt)
        except click.BadParameter as exc:
            raise click.UsageError(f"{label} {alt}: {exc.format_message()}") from None


def check_synopsis(argv: list[str]) -> None:
    """A synopsis (``[--flag VALUE]``, ``a|b``, ``...``): the subcommand, every flag's name, and
    every value written out (not a placeholder) for its option or argument."""
    cmd, names, rest = resolve([t.strip("[]") for t in argv])
    known = option_names(cmd)
    for token in rest:
        for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", token):
            if flag not in known:
                raise click.UsageError(f"{' '.join(names)} has no option {flag}")
    options = {o: p for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
    arguments = [p for p in cmd.params if isinstance(p, click.Argument)]
    tokens = [t.strip("[]") for t in rest]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":  # the rest goes to another program (vLLM's flags)
            return
        if token.startswith("-"):
            flag, eq, value = token.split("|")[0].partition("=")
            option = options.get(flag)
            if option is None or option.is_flag or option.count:
                continue
            if not eq:
                if i == len(tokens) or tokens[i].startswith("-"):
                    continue  # no value written (prose naming the flag)
                value, i = tokens[i], i + 1
            check_value(cmd, names, option, value)
        elif token != "...":
            if not arguments:
                raise click.UsageError(f"{' '.join(names)} takes no argument {token!r}")
            argument = arguments[0] if arguments[0].nargs == -1 else arguments.pop(0)
            check_value(cmd, names, argument, token)


def check_kvtier(argv: list[str], prose: bool = False) -> None:
    """Parse ``argv`` with the real CLI (and name its model, if it takes one). In prose (an
    inline span naming a command or a flag), a trailing flag without its value and missing
    required arguments are fine."""
    cmd, names, rest = resolve(argv)
    if isinstance(cmd, click.Group):
        unknown = [t for t in rest if t not in option_names(cmd)]
        if unknown:
            raise click.UsageError(f"{' '.join(names)} needs a subcommand, got {rest}")
        return
    if any(t in ("--help", "-h") for t in rest):
        return
    if prose:
        check_synopsis(argv)
        option = next((p for p in cmd.params if rest and rest[-1] in getattr(p, "opts", ())), None)
        if isinstance(option, click.Option) and not option.is_flag:
            rest = rest[:-1]
    try:
        ctx = lenient(cmd).make_context(" ".join(names), list(rest))
    except click.MissingParameter as exc:
        if not (prose and isinstance(exc.param, click.Argument)):
            raise
        return
    with ctx:
        model = ctx.params.get("model")
        if isinstance(model, str) and (problem := model_problem(model)):
            raise click.UsageError(f"{' '.join(names)}: {problem}")


@cache
def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def line_problems(line: str, in_prose: bool = False) -> list[str]:
    """What is wrong with one command line of the docs (a shell line, or an inline span)."""
    problems = []
    words = synopsis_argv(line)
    try:
        commands = [words] if words is not None else split_commands(line)
    except ValueError as exc:  # unbalanced quotes
        return [f"cannot split {line!r}: {exc}"]
    for argv in commands:
        argv[0] = re.sub(r"^(\./)?\.venv/bin/", "", argv[0])
        if argv[0] == "kvtier":
            try:
                if words is not None:
                    check_synopsis(argv)
                else:
                    check_kvtier(argv, in_prose)
            except click.ClickException as exc:
                problems.append(f"{' '.join(argv)}\n    {exc.format_message()}")
        elif argv[0] == "make":
            missing = [t for t in argv[1:] if not t.startswith("-") and "=" not in t and t not in makefile_targets()]
            if missing:
                problems.append(f"make has no target {missing}")
    return problems


def command_problems(page: Path) -> list[str]:
    return [f"{where}: {problem}" for where, line, in_prose in shell_commands(page)
            for problem in line_problems(line, in_prose)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kvtier_command_parses(page: Path):
    problems = command_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("line", "in_prose"), [
    ("kvtier serve smolm2", False),                                  # a misspelt model
    ("kvtier serve smolm2", True),
    ("kvtier serve smolm2 [--port 8000]", False),
    ("kvtier serve smollm2 --disk-codec BOGUS", False),              # a choice is never a placeholder
    ("kvtier serve MODEL [--disk-codec none|int9]", False),          # each alternative is checked
    ("kvtier demo [--model smollm2|tyni|DIR]", False),
    ("kvtier serve smollm2 [--port 99999]", False),                  # a number out of range
    ("kvtier bench workload-sharegpt [--max-context 8192|nope]", False),
    ("kvtier bench keys extra [--json]", False),                     # an argument it does not take
    ("kvtier bench keys --jsn", True),
    ("make no-such-target", False),
])
def test_a_wrong_command_is_found(line: str, in_prose: bool):
    assert line_problems(line, in_prose)


@pytest.mark.parametrize("line", [
    "kvtier serve smollm2", "kvtier serve MODEL", "kvtier serve <model> [--port 8000]",
    "kvtier serve HuggingFaceTB/SmolLM2-135M-Instruct", "kvtier serve ./smollm2 -- --dtype float32",
    "kvtier serve MODEL [--disk-codec none|int8] [-- any vLLM flags]", "kvtier demo [--model smollm2|tiny|DIR]",
    "kvtier replay TRACE --policy lru cost --dram-blocks N", "kvtier bench workload-sharegpt [--max-context 8192|none]",
])
def test_a_right_command_passes(line: str):
    assert not line_problems(line)


def test_the_first_screen_starts_with_make_demo_then_make_test():
    first = next(b for b in blocks(README) if b.lang in SHELL)
    assert [argv for line in first.text.splitlines() for argv in split_commands(line)] == [
        ["make", "demo"], ["make", "test"]]
    before = README.read_text().splitlines()[: first.line]
    assert [line for line in before if line.startswith("#")] == ["# kvtier", "## Quick start"]
    assert first.line < 30


# -- TOML ---------------------------------------------------------------------------------------


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


TOML_BLOCKS = [b for page in PAGES for b in blocks(page) if b.lang == "toml"]


def test_every_daemon_toml_is_read_by_the_daemon(tmp_path: Path):
    from kvtier.server.config import daemon_config

    problems = []
    whole: dict[Path, dict] = {}
    for block in TOML_BLOCKS:
        raw = tomllib.loads(block.text)
        if "host" not in raw:
            if block.page not in whole:
                problems.append(f"{block.where}: a fragment with no whole config before it")
                continue
            raw = merged(whole[block.page], raw)
        else:
            whole[block.page] = raw
        raw = dict(raw, socket=str(tmp_path / "kvtier.sock"))
        try:
            daemon_config(raw)
        except (ValueError, TypeError) as exc:
            problems.append(f"{block.where}: {exc}")
    assert TOML_BLOCKS
    assert not problems, "\n".join(problems)


# -- kvtier names and repository paths ----------------------------------------------------------

SLOW_OR_ABSENT = ("vllm", "lmcache")
"""Packages a module is not imported for (vLLM takes seconds to import; LMCache is not installed
here): a module that would import one is read from its source instead."""


def module_file(parts: list[str]) -> Path | None:
    path = SRC.parent.joinpath(*parts)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def eager_imports(module: str) -> set[str]:
    """The modules importing ``module`` imports at once: its module-level imports (not those in
    a function or under ``if TYPE_CHECKING``), made absolute."""
    path = module_file(module.split("."))
    if path is None:
        return set()
    package = module.split(".")[: None if path.name == "__init__.py" else -1]
    out: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                walk(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])

    walk(ast.parse(path.read_text()).body)
    return out


@cache
def import_is_slow_or_absent(module: str) -> bool:
    """Whether importing ``module`` (its packages first) would import one of
    :data:`SLOW_OR_ABSENT` or a package that is not installed."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        parts = todo.pop().split(".")
        if parts[0] != "kvtier":
            if parts[0] in SLOW_OR_ABSENT or importlib.util.find_spec(parts[0]) is None:
                return True
            continue
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in seen:
                seen.add(name)
                todo.extend(eager_imports(name))
    return False


def assigned_attributes(klass: type) -> set[str]:
    """What instances of ``klass`` have that the class may not: annotated fields (a dataclass's
    without a default) and ``self.x = ...`` in its methods, its bases' too."""
    names: set[str] = set()
    for k in klass.__mro__:
        names.update(inspect.get_annotations(k))
        names.update(getattr(k, "__slots__", ()))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(k)))
        except (OSError, TypeError, SyntaxError):
            continue
        names.update(n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                     and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == "self")
    return names


def imported_name_problem(dotted: str) -> str | None:
    """``dotted`` resolved as Python does: the module imported, then an attribute at a time (a
    re-export, a lazily imported name, a method a base class defines, an instance's field)."""
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for depth in range(1, len(parts)):
        here, attr = ".".join(parts[:depth]), parts[depth]
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif inspect.ismodule(obj) and module_file(parts[: depth + 1]) is not None:
            obj = importlib.import_module(f"{here}.{attr}")
        elif inspect.isclass(obj) and attr in assigned_attributes(obj):
            return None  # an instance's attribute (its own attributes are not checked)
        else:
            return f"{dotted}: {here} has no {attr!r}"
    return None


def defined_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(defined_names(node.body))
    return names


def source_name_problem(module: str, rest: list[str]) -> str | None:
    """``module.rest`` resolved from the source, for a module that is not imported: a re-export
    followed to the module it comes from, a class's attribute looked for in its body (methods,
    fields, ``self.x = ...``) and then in its bases that kvtier defines (a base from another
    package is not read: the name is taken as found)."""
    dotted = ".".join([module, *rest])
    path = module_file(module.split("."))
    assert path is not None
    names = defined_names(ast.parse(path.read_text()).body)
    if not rest:
        return None
    node = names.get(rest[0])
    if node is None:
        return f"{dotted}: {module} defines no {rest[0]!r}"
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvtier"):
        alias = next(a for a in node.names if (a.asname or a.name) == rest[0])
        return name_problem(".".join([node.module, alias.name, *rest[1:]]))
    if len(rest) == 1:
        return None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{dotted}: {module}.{rest[0]} is a function, it has no {rest[1]!r}"
    if not isinstance(node, ast.ClassDef):
        return None  # a value's attributes are not checked
    members = defined_names(node.body)
    members.update({n.attr: n for n in ast.walk(node) if isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == "self"})
    if rest[1] in members:
        return None  # (an attribute's attributes are not checked)
    for base in node.bases:
        if not isinstance(base, ast.Name):
            return None
        if base.id in names and isinstance(names[base.id], ast.ClassDef):
            found = source_name_problem(module, [base.id, *rest[1:]])
        elif isinstance(bound := names.get(base.id), ast.ImportFrom) and (bound.module or "").startswith("kvtier"):
            alias = next(a for a in bound.names if (a.asname or a.name) == base.id)
            found = name_problem(".".join([bound.module, alias.name, *rest[1:]]))
        else:
            return None  # a base kvtier does not define
        if found is None:
            return None
    return f"{dotted}: {module}.{rest[0]} and its bases define no {rest[1]!r}"


def name_problem(dotted: str) -> str | None:
    """Why ``dotted`` (``kvtier.a.b.Name.attr``) names nothing in src/kvtier, or None. Imported and resolved as Python does, unless importing the module
    would import vLLM (seconds) or a package not installed here: then read from the source."""
    parts = dotted.split(".")
    i = len(parts)
    while i > 0 and module_file(parts[:i]) is None:
        i -= 1
    if i == 0:
        return f"{dotted}: no module"
    module = ".".join(parts[:i])
    if import_is_slow_or_absent(module):
        return source_name_problem(module, parts[i:])
    return imported_name_problem(".".join(parts))


def code_texts(page: Path) -> Iterator[tuple[str, str]]:
    for b in blocks(page):
        yield b.where, b.text
    for text in spans(page):
        yield f"{page.relative_to(ROOT)} `{text}`", text


def dotted_names(page: Path) -> Iterator[tuple[str, str]]:
    for where, text in code_texts(page):
        for m in re.finditer(r"\bfrom[ \t]+(kvtier[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[\w \t,]+)", text):
            yield where, m.group(1)
            for name in m.group(2).strip("()").split(","):
                if name.split():
                    yield where, f"{m.group(1)}.{name.split()[0]}"
        for m in re.finditer(r"(?m)^\s*import\s+(kvtier[\w.]*)", text):
            yield where, m.group(1)
        for m in re.finditer(r"""["'](kvtier(?:\.\w+)+)["']""", text):
            yield where, m.group(1)
    for text in spans(page):
        m = re.fullmatch(r"(kvtier(?:\.\w+)+)(\(.*\)|\[.*\])?", text)
        if m:
            yield f"{page.relative_to(ROOT)} `{text}`", m.group(1)


def repo_paths(page: Path) -> Iterator[str]:
    for m in re.finditer(r"(?<![\w/.~-])((?:src|tests|scripts)/[\w./-]*\w)", page.read_text()):
        yield m.group(1)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_kvtier_names_and_paths_exist(page: Path):
    problems = sorted({f"{where}: {p}" for where, name in dotted_names(page) if (p := name_problem(name))})
    problems += sorted({f"{page.relative_to(ROOT)}: no file {path}" for path in repo_paths(page)
                        if not (ROOT / path).exists()})
    assert not problems, "\n".join(problems)


def test_a_name_is_resolved_as_python_resolves_it():
    assert name_problem("kvtier.nope")
    assert name_problem("kvtier.store.KVStore.nope")                    # through a lazy re-export
    assert name_problem("kvtier.KVStore.nope")
    assert name_problem("kvtier.store.cache.ChunkCache.lookup_keys") is None   # on its CacheLookups base
    assert name_problem("kvtier.KVStore.lookup") is None
    assert name_problem("kvtier.store.results.SaveResult.unpersisted") is None   # a dataclass field


def test_a_name_in_a_module_that_needs_vllm_is_read_from_its_source():
    assert import_is_slow_or_absent("kvtier.engines.vllm.scheduler")    # its package imports vLLM
    assert not import_is_slow_or_absent("kvtier.store.cache")
    assert name_problem("kvtier.engines.vllm.KVTierConnector") is None  # a re-export
    assert name_problem("kvtier.engines.vllm.Nope")
    # vLLM's hook, defined on the Lookups base of the connector's scheduler side
    assert name_problem("kvtier.engines.vllm.scheduler.SchedulerSide.get_num_new_matched_tokens") is None
    assert name_problem("kvtier.engines.vllm.scheduler.SchedulerSide.nope")
    assert name_problem("kvtier.engines.vllm.offline.drain.nope")       # a function's attribute


# -- links --------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, link text kept, punctuation but ``-`` and
    ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings(page: Path):
    problems = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", prose(page)):
        target = m.group(1)
        if re.match(r"[a-z][\w+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            problems.append(f"{target}: no heading #{fragment} in {file.name}")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme_and_the_index():
    readme = README.read_text()
    index = (ROOT / "docs" / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
            assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"
