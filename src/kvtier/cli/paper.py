"""``kvtier replay TRACE --paper attentionstore``: AttentionStore's evaluation beside kvtier's."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _bytes(n: int | None) -> str:
    if n is None:
        return "all"
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 2**30:.1f} GiB"


def paper_cmd(trace: str, policies: tuple[str, ...], stated: dict[str, object], capacity_scale: float | None,
              models: str | None, as_json: bool) -> None:
    """``stated``: the :class:`~kvtier.bench.paper.Setup` fields given on the command line."""
    from kvtier.bench import paper
    from kvtier.bench.trace import TraceError, load_trace
    from kvtier.core.policy import POLICIES

    err = Console(stderr=True)
    names = policies or paper.POLICIES + paper.BOUNDS
    unknown = [n for n in names if n not in POLICIES and n != "unlimited"]
    if unknown:
        raise click.UsageError(f"unknown policy {unknown[0]!r}; known: {[*POLICIES, 'unlimited']}")
    chosen = tuple(m.strip() for m in models.split(",") if m.strip()) if models else tuple(paper.MODELS)
    try:
        paper.check_models(chosen)  # before minutes of calibration
        setup = paper.Setup(**stated)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        tr = load_trace(trace)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from exc
    if not any(r.session_id is not None for r in tr.requests):
        raise click.UsageError(f"{trace} names no sessions: --paper needs a sessions trace "
                               "(kvtier bench workload-sharegpt --out FILE writes one)")
    try:
        if capacity_scale is None:
            name, policy, dram_only, target = paper.CALIBRATE_ON
            err.print(f"calibrating the capacity scale on {name}, {policy}, "
                      f"{'DRAM only' if dram_only else 'DRAM and SSD'}: the paper's {target:.0%}")
            cal = paper.calibrate(tr, setup, progress=lambda s, h: err.print(f"  scale {s:.4f}: hit rate {h:.1%}"))
            scale, calibrated, fit_hit = cal.scale, cal.reached, cal.hit_rate
            if cal.reached:
                err.print(f"calibrated: capacity scale {cal.scale:.4f} (hit rate {cal.hit_rate:.1%}); "
                          f"--capacity-scale {cal.scale:.4f} skips this next time")
            else:
                err.print(f"[yellow]warning:[/] the bisection found no capacity scale in (0.001, 1) giving "
                          f"{target:.0%} on this trace within a point (it ended at {cal.scale:.4f}: "
                          f"{cal.hit_rate:.1%}): the comparison below is not calibrated")
        else:
            scale, calibrated, fit_hit = capacity_scale, False, None
        done = []

        def progress(row: paper.PaperRow) -> None:
            done.append(row)
            err.print(f"  [{len(done)}] {row.model} x{row.capacity:g} "
                      f"{'DRAM' if row.dram_only else 'DRAM+SSD'} {row.policy}: hit {row.hit_rate:.1%}, "
                      f"prefill saved {row.prefill_saved:.1%}")

        table = paper.rows(tr, scale, setup, policies=names, models=chosen, progress=progress)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if as_json:
        click.echo(json.dumps([{**r.as_dict(), "capacity_scale": scale * r.capacity, "calibrated": calibrated,
                                "calibration_hit_rate": fit_hit, "think": setup.think, "think_s": setup.think_mean_s,
                                "ssd_gbps": setup.ssd_read_GBps, "dram_gbps": setup.dram_read_GBps,
                                "decode_ms_per_token": setup.decode_s_per_token * 1e3,
                                "loop": "closed" if setup.closed_loop else "open"} for r in table], indent=2))
        return
    def is_fitted(r: paper.PaperRow) -> bool:
        return calibrated and paper.CALIBRATE_ON[:3] == (r.model, r.policy, r.dram_only) and r.capacity == 1.0

    how = "calibrated" if calibrated else "not calibrated" if fit_hit is not None else "given"
    out = Console(width=max(Console().width, 150))
    t = Table(title=f"AttentionStore (ATC '24) beside kvtier on {trace}: {len(tr.requests)} requests; "
                    f"capacities x{scale:.4f} ({how}), think {setup.think} {setup.think_mean_s:g} s "
                    f"({'closed' if setup.closed_loop else 'open'} loop), decode "
                    f"{setup.decode_s_per_token * 1e3:g} ms a token, SSD {setup.ssd_read_GBps:g} GB/s, "
                    f"DRAM {setup.dram_read_GBps:g} GB/s")
    for col in ("model", "x", "DRAM", "SSD", "policy", "hit rate", "paper hit", "diff pts", "from DRAM",
                "paper DRAM", "prefill saved", "TTFT s"):
        t.add_column(col, justify="left" if col in ("model", "policy") else "right", no_wrap=True)
    for r in table:
        diff = "-" if r.paper_hit_rate is None else f"{100 * (r.hit_rate - r.paper_hit_rate):+.1f}"
        if is_fitted(r):
            diff += " (fitted)"
        t.add_row(r.model, f"{r.capacity:g}", _bytes(r.dram_bytes),
                  "-" if r.dram_only and r.policy != "unlimited" else _bytes(r.ssd_bytes), r.policy,
                  _pct(r.hit_rate), _pct(r.paper_hit_rate), diff, _pct(r.dram_share_of_hits),
                  _pct(r.paper_dram_share), _pct(r.prefill_saved), f"{r.ttft_mean_s:.3f}")
    out.print(t)
    compared = [r for r in table if r.paper_hit_rate is not None and not is_fitted(r)]
    close = [r for r in compared if abs(r.hit_rate - r.paper_hit_rate) <= 0.05]  # type: ignore[operator]
    if compared:
        out.print(f"within 5 points of the paper: {len(close)} of {len(compared)} published hit rates"
                  + (" (besides the one fitted)" if any(map(is_fitted, table)) else ""))
    for policy in ("returns", "cost"):
        found = paper.gains(table, policy)
        if found:
            out.print(f"{policy} / attentionstore, prefill saved: " + ", ".join(
                f"{m} {'DRAM' if d else 'DRAM+SSD'} x{c:g} " + ("n/a" if g is None else f"{g:.2f}x")
                for m, d, c, g in found))
