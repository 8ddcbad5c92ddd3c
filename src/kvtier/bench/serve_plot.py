"""A figure of ``kvtier bench serve``'s report: TTFT against step, one line per configuration.

Step is a record's ``turn``: the turn of a conversation (0: its first), or for a trace
(:mod:`kvtier.bench.serve_trace`) how many earlier requests shared the request's first block.
Per configuration and step, the line is the median TTFT over every run's records at that step
and the band spans their 25th to 75th percentiles. The figure is drawn on its own
:class:`~matplotlib.figure.Figure` with the Agg canvas: pyplot and matplotlib's global settings
are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

__all__ = ["FORMATS", "plot_ttft_by_step", "ttft_by_step"]

FORMATS = (".png", ".svg", ".pdf")


def ttft_by_step(report: Mapping[str, object]) -> dict[str, dict[int, list[float]]]:
    """Configuration (in the order they first ran) -> step -> TTFT in ms of every run's records
    at that step (from :meth:`kvtier.bench.serve_report.ServeBenchReport.as_dict`)."""
    results = report.get("results")
    if not isinstance(results, list):
        raise ValueError("the report has no 'results' list (expected ServeBenchReport.as_dict())")
    out: dict[str, dict[int, list[float]]] = {}
    for result in results:
        steps = out.setdefault(str(result["name"]), {})
        for record in result.get("turns") or []:
            if record.get("ttft_s") is not None:
                steps.setdefault(int(record["turn"]), []).append(1000.0 * float(record["ttft_s"]))
    return out


def plot_ttft_by_step(report: Mapping[str, object], path: str | Path, *, title: str | None = None) -> Path:
    """Draw the report's TTFT (ms) against step, every configuration's median as a line with
    markers and its 25th-75th percentile band shaded, into ``path``, in the format its suffix
    names (:data:`FORMATS`); returns ``path``. Raises ``ValueError`` for another suffix or a
    report with no TTFT to draw (before writing anything)."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot plot to {path.name}: suffix {path.suffix or '(none)'!r} is not one of "
                         f"{', '.join(FORMATS)}")
    data = {name: steps for name, steps in ttft_by_step(report).items() if steps}
    if not data:
        raise ValueError("the report holds no TTFT to plot (no configuration has a record)")
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, steps in data.items():
        x = sorted(steps)
        q25, q50, q75 = (np.array([np.percentile(steps[s], q) for s in x]) for q in (25, 50, 75))
        (line,) = ax.plot(x, q50, marker="o", markersize=4, label=name)
        ax.fill_between(x, q25, q75, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("step (turn)")
    ax.set_ylabel("TTFT ms")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(title="median, 25-75th percentile")
    ax.set_title(title if title is not None else "TTFT by step")
    # SVG text as text (not paths): searchable, and smaller; only for this save
    with rc_context({"svg.fonttype": "none"}):
        fig.savefig(path, format=suffix[1:])
    return path
