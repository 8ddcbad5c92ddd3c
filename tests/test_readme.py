"""The README and the docs, run or checked as written.

- README.md's ```python blocks run, in a temporary directory (each builds what it needs: a
  small layout and config, so the whole file takes seconds).
- Every ``kvtier ...`` command in README.md, CONTRIBUTING.md and docs/*.md -- lines of
  ```bash/sh/shell/console blocks, and inline code spans that start with ``kvtier `` -- is parsed
  by the real click CLI (:data:`kvtier.cli.main`): the subcommand exists, every flag exists and
  takes its value, values convert (choices, sizes, numbers), required arguments are there.
  Nothing runs. A synopsis (a line with ``[--flag]``, ``a|b`` alternatives or ``...``) is
  checked for its subcommand and flag names only. ``make X`` names a Makefile target.
- Every ```toml block that configures the daemon is read by :func:`kvtier.server.config.daemon_config`
  (with the socket moved into a temporary directory); a fragment (no ``[host]``) is read merged
  over the previous whole config of its page, as the page says to use it.
- ``kvtier.*`` names in code (``from kvtier.x import y``, a span that is a dotted name, a quoted
  module path) name a module under src/kvtier and a name defined there, read from the source
  without importing it; ``src/``, ``tests/`` and ``scripts/`` paths exist.
- Every relative link points to a file that exists, and a ``#fragment`` to a heading in it.

A block that needs a server, a model or a long run is marked in the markdown by an HTML comment
on the line before it, ``<!-- needs: server -->``: a python block so marked is skipped with that
reason; the commands of a shell block so marked are still parsed (parsing starts nothing).
"""

from __future__ import annotations

import ast
import copy
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
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


# -- README's python blocks ---------------------------------------------------------------------

PYTHON_BLOCKS = [b for b in blocks(README) if b.lang in ("python", "py")]


def test_the_readme_has_a_runnable_python_example():
    assert [b for b in PYTHON_BLOCKS if b.needs is None]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_readme_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  tiny_model_dir: Path):
    if block.needs is not None:
        pytest.skip(f"{block.where} needs {block.needs}")
    # kvtier's home is the suite's, where the embedded tiny model is already built (never ~/.cache)
    monkeypatch.setenv("KVTIER_HOME", str(tiny_model_dir.parents[1]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    code = compile(block.text, block.where, "exec")
    exec(code, {"__name__": "__readme__"})  # noqa: S102 - running the README's example is the test


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


def check_synopsis(argv: list[str]) -> None:
    cmd, names, rest = resolve([t.strip("[]") for t in argv])
    known = option_names(cmd)
    for token in rest:
        for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", token):
            if flag not in known:
                raise click.UsageError(f"{' '.join(names)} has no option {flag}")


def check_kvtier(argv: list[str], prose: bool = False) -> None:
    """Parse ``argv`` with the real CLI. In prose (an inline span naming a command or a flag),
    a trailing flag without its value and missing required arguments are fine."""
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
        lenient(cmd).make_context(" ".join(names), list(rest)).close()
    except click.MissingParameter as exc:
        if not (prose and isinstance(exc.param, click.Argument)):
            raise


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def command_problems(page: Path) -> list[str]:
    problems = []
    targets = makefile_targets()
    for where, line, in_prose in shell_commands(page):
        words = synopsis_argv(line)
        try:
            commands = [words] if words is not None else split_commands(line)
        except ValueError as exc:  # unbalanced quotes
            problems.append(f"{where}: cannot split {line!r}: {exc}")
            continue
        for argv in commands:
            argv[0] = re.sub(r"^(\./)?\.venv/bin/", "", argv[0])
            if argv[0] == "kvtier":
                try:
                    if words is not None:
                        check_synopsis(argv)
                    else:
                        check_kvtier(argv, in_prose)
                except click.ClickException as exc:
                    problems.append(f"{where}: {' '.join(argv)}\n    {exc.format_message()}")
            elif argv[0] == "make":
                missing = [t for t in argv[1:] if not t.startswith("-") and "=" not in t and t not in targets]
                if missing:
                    problems.append(f"{where}: make has no target {missing}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kvtier_command_parses(page: Path):
    problems = command_problems(page)
    assert not problems, "\n".join(problems)


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


def module_file(parts: list[str]) -> Path | None:
    path = SRC.parent.joinpath(*parts)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
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


def name_problem(dotted: str) -> str | None:
    """Why ``dotted`` (``kvtier.a.b.Name.attr``) names nothing in src/kvtier, or None."""
    parts = dotted.split(".")
    i = len(parts)
    while i > 0 and module_file(parts[:i]) is None:
        i -= 1
    if i == 0:
        return f"{dotted}: no module"
    source = module_file(parts[:i])
    assert source is not None
    scope: list[ast.stmt] = ast.parse(source.read_text()).body
    for depth, attr in enumerate(parts[i:]):
        names = defined_names(scope)
        if attr not in names:
            return f"{dotted}: {'.'.join(parts[:i + depth])} defines no {attr!r}"
        node = names[attr]
        if not isinstance(node, ast.ClassDef):
            return None  # a function's or a value's attributes are not checked
        scope = node.body
    return None


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
