"""Option types and output helpers shared by the ``kvtier`` commands."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

import click
from rich.console import Console

from kvtier.core.sizes import parse_size

T = TypeVar("T")


class MiBList(click.ParamType):
    """A comma-separated list of positive whole MiB, e.g. ``1,16``."""

    name = "MIB[,MIB...]"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None
                ) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        parts = [p.strip() for p in str(value).split(",")]
        try:
            sizes = tuple(int(p) for p in parts)
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of whole MiB (e.g. 1,16)",
                      param, ctx)
        if any(s <= 0 for s in sizes):
            self.fail(f"chunk sizes must be positive, got {value!r}", param, ctx)
        return sizes


def emit_json(payload: dict[str, object]) -> None:
    click.echo(json.dumps(payload, indent=2))


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


class ByteSize(click.ParamType):
    """A byte count such as ``64GiB``, ``1.5TB`` or ``1048576``."""

    name = "BYTES"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None
                ) -> int:
        try:
            return parse_size(value)
        except ValueError:
            self.fail(f"{value!r} is not a size like 64GiB, 500GB or 1048576", param, ctx)


def _run_with_status(run: Callable[..., T], config: object, what: str, *, quiet: bool) -> T:
    """``run(config)``; unless ``quiet`` (JSON on stdout), with a spinner on stderr naming
    ``what`` and then each step ``run`` reports through its ``progress``."""
    if quiet:
        return run(config)
    with Console(stderr=True).status(f"{what}...") as status:
        return run(config, progress=lambda msg: status.update(f"{msg}..."))
