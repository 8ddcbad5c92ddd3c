"""``kvtier store``: the store daemon (serve) and its statistics."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.common import emit_json, size_text


@click.group()
def store() -> None:
    """The store daemon: one cache shared by several processes (vLLM instances, workers)."""


@store.command("serve")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config file; flags override it.")
@click.option("--socket", "socket_path", default=None, help="Unix socket to serve on.")
@click.option("--model", default=None, help="Weights fingerprint (part of every key).")
@click.option("--model-dir", default=None, type=click.Path(file_okay=False),
              help="Derive fingerprint and KV layout from a local model directory.")
@click.option("--host-bytes", type=click.IntRange(min=1), default=None, help="DRAM tier size.")
@click.option("--disk-path", default=None, help="SSD tier directory.")
@click.option("--disk-bytes", type=click.IntRange(min=1), default=None, help="SSD tier size.")
@click.option("--write-through/--no-write-through", default=None,
              help="Write every saved chunk to SSD at once.")
@click.option("--metrics-port", type=click.IntRange(min=0), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT.")
def store_serve(config_path: str | None, socket_path: str | None, model: str | None,
                model_dir: str | None, host_bytes: int | None, disk_path: str | None,
                disk_bytes: int | None, write_through: bool | None, metrics_port: int | None) -> None:
    """Run the store daemon until interrupted."""
    import logging
    import signal

    from kvtier.server.config import daemon_config, read_toml
    from kvtier.server.daemon import StoreDaemon

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        raw: dict[str, object] = read_toml(config_path) if config_path else {}
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    flags = {"socket": socket_path, "model": model, "model_dir": model_dir,
             "write_through": write_through, "metrics_port": metrics_port}
    raw.update({k: v for k, v in flags.items() if v is not None})
    if host_bytes is not None:
        raw["host"] = {**dict(raw.get("host") or {}), "capacity_bytes": host_bytes}  # type: ignore[call-overload]
    if disk_path is not None or disk_bytes is not None:
        raw["disk"] = {**dict(raw.get("disk") or {}),  # type: ignore[call-overload]
                       **({"path": disk_path} if disk_path else {}),
                       **({"capacity_bytes": disk_bytes} if disk_bytes else {})}
    try:
        daemon = StoreDaemon(daemon_config(raw))
    except (ValueError, TypeError) as exc:
        raise click.ClickException(str(exc)) from exc

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    where = f"; metrics on http://{daemon.metrics_address[0]}:{daemon.metrics_address[1]}/metrics" \
        if daemon.metrics_address else ""
    click.echo(f"kvtier store serving {daemon.config.socket_path}{where}", err=True)
    try:
        daemon.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        daemon.stop()


@store.command("stats")
@click.option("--socket", "socket_path", required=True, help="The daemon's Unix socket.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw snapshot as JSON.")
def store_stats(socket_path: str, as_json: bool) -> None:
    """Capacity, use, hits and misses per tier of a running daemon."""
    from kvtier.server.client import DaemonUnavailable, StoreClient

    client = StoreClient(socket_path)
    try:
        snap = client.stats()
    except DaemonUnavailable as exc:
        raise click.ClickException(f"no kvtier daemon at {socket_path}: {exc}") from exc
    finally:
        client.close()
    if as_json:
        emit_json(snap)
        return
    table = Table(title=f"kvtier store at {socket_path}")
    for col in ("tier", "capacity", "used", "chunks", "hits", "misses", "hit ratio", "evictions",
                "read", "written", "errors"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in snap["tiers"].items():  # type: ignore[union-attr]
        hits, misses = t["hits"], t["misses"]
        table.add_row(name, size_text(t["capacity_bytes"]), size_text(t["used_bytes"]), str(t["chunks"]),
                      str(hits), str(misses), f"{hits / (hits + misses):.1%}" if hits + misses else "-",
                      str(t["evictions"]), size_text(t["io"]["bytes_read"]),
                      size_text(t["io"]["bytes_written"]), str(t["io"]["errors"]))
    console = Console()
    console.print(table)
    console.print(f"clients {snap['clients']}, pinned chunks {snap['pinned_chunks']}, "
                  f"promotions {snap['promotions']}, demotions {snap['demotions']}")
