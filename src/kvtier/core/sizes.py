"""Human-readable byte sizes: ``16GiB``, ``500GB``, ``1.5TiB``, ``1048576``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
          "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(value: object, what: str = "size") -> int:
    """Bytes in ``value``: an int, or a string like ``64GiB``, ``500GB``, ``1.5T`` (K/M/G/T alone
    are binary units). ValueError naming ``what`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size like 16GiB or a number of bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must not be negative, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        unit = m.group(2).upper() if m else ""
        if m is not None and unit in _UNITS:
            return int(float(m.group(1)) * _UNITS[unit])
    raise ValueError(f"{what} must be a size like 16GiB, 500GB or 1048576, got {value!r}")
