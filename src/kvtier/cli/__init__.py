"""The ``kvtier`` command line. Thin: it parses options, calls into the library, prints.

Layout: ``main`` is the root group; each area is a module of this package with its group or
command, registered here: ``bench``, ``demo``, ``replay``, ``serve``, ``store``; option types and output
helpers live in :mod:`kvtier.cli.common`. A command builds the library's typed config from its
options, turns the library's ``ValueError`` into a click error (non-zero exit, one clear line)
and prints either ``--json`` (one JSON object on stdout) or a rich table.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import click

from kvtier.cli.bench import bench
from kvtier.cli.demo import demo
from kvtier.cli.replay import replay_cmd
from kvtier.cli.serve import serve
from kvtier.cli.store import store

__all__ = ["main"]


def _version() -> str:
    try:
        return version("kvtier")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", prog_name="kvtier")
def main() -> None:
    """kvtier: a tiered KV-cache store (host DRAM, SSD, a shared remote tier) for LLM inference."""


main.add_command(bench)
main.add_command(demo)
main.add_command(replay_cmd)
main.add_command(serve)
main.add_command(store)


if __name__ == "__main__":  # pragma: no cover
    main()
