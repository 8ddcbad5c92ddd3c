"""Where kvtier keeps what it builds for its user (models, weight digests, peers' venvs)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["kvtier_home"]


def kvtier_home() -> Path:
    """``$KVTIER_HOME``, default ``~/.cache/kvtier`` (read at each call: tests point it elsewhere)."""
    return Path(os.environ.get("KVTIER_HOME") or Path.home() / ".cache" / "kvtier")
