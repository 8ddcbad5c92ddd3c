"""``kvtier store``: the store daemon (serve) and its statistics."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from kvtier.cli.common import ByteSize, emit_json, size_text


@click.group()
def store() -> None:
    """The store daemon: one cache shared by several processes (vLLM instances, workers) of
    any models."""


def _gone(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value:
        raise click.UsageError(f"{param.opts[0]} is gone: the daemon serves any model, and each "
                               "client (the vLLM connector, a transformers engine) names its own")


@store.command("serve")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config file; flags override it.")
@click.option("--socket", "socket_path", default=None,
              help="Unix socket to serve on [default: $KVTIER_SOCKET, $XDG_RUNTIME_DIR/kvtier.sock "
                   "or /tmp/kvtier-<uid>/kvtier.sock].")
@click.option("--host-bytes", type=ByteSize(), default=None, help="DRAM tier size, e.g. 16GiB.")
@click.option("--disk-path", default=None, help="SSD tier directory.")
@click.option("--disk-bytes", type=ByteSize(), default=None, help="SSD tier size, e.g. 500GiB.")
@click.option("--disk-codec", type=click.Choice(["none", "fp8", "int8", "int4", "auto"]), default=None,
              help="Store SSD chunks compressed (lossy; default none: exact).")
@click.option("--policy", default=None, help="Placement policy: lru, fifo, attentionstore, cost, returns.")
@click.option("--tenant", default=None, help="Tenant of clients that name none.")
@click.option("--write-through/--no-write-through", default=None,
              help="Also write every saved chunk to SSD (in the background).")
@click.option("--metrics-port", type=click.IntRange(min=0, max=65535), default=None,
              help="Serve Prometheus metrics on 127.0.0.1:PORT.")
@click.option("--hint-share", type=click.FloatRange(0.0, 1.0), default=None,
              help="Share of DRAM + SSD one tenant's retained sessions (session hints) may hold "
                   "[default: 0.5; 0: no retention].")
@click.option("--model", hidden=True, callback=_gone, expose_value=False)
@click.option("--model-dir", hidden=True, callback=_gone, expose_value=False)
def store_serve(config_path: str | None, socket_path: str | None, host_bytes: int | None,
                disk_path: str | None, disk_bytes: int | None, disk_codec: str | None,
                policy: str | None, tenant: str | None,
                write_through: bool | None, metrics_port: int | None, hint_share: float | None) -> None:
    """Run the store daemon until interrupted (no model needed: clients name theirs)."""
    import logging
    import signal

    from kvtier.server.config import daemon_config, read_toml
    from kvtier.server.service import StoreService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        raw: dict[str, object] = read_toml(config_path) if config_path else {}
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    flags = {"socket": socket_path, "policy": policy, "tenant": tenant,
             "write_through": write_through, "metrics_port": metrics_port, "hint_share": hint_share}
    raw.update({k: v for k, v in flags.items() if v is not None})
    if host_bytes is not None:
        raw["host"] = {**dict(raw.get("host") or {}), "capacity_bytes": host_bytes}  # type: ignore[call-overload]
    if disk_path is not None or disk_bytes is not None or disk_codec is not None:
        raw["disk"] = {**dict(raw.get("disk") or {}),  # type: ignore[call-overload]
                       **({"path": disk_path} if disk_path else {}),
                       **({"capacity_bytes": disk_bytes} if disk_bytes else {}),
                       **({"codec": disk_codec} if disk_codec else {})}
    disk = raw.get("disk")
    if isinstance(disk, dict) and not {"path", "capacity_bytes"} <= disk.keys():
        raise click.UsageError("an SSD tier needs --disk-path and --disk-bytes (or path and capacity_bytes "
                               "in the config's [disk] section)")
    try:
        config = daemon_config(raw)
        render = None
        if config.http_lookup:  # (transformers is imported only for a daemon that renders chats)
            from kvtier.engines.chat_render import ChatRenderer

            render = ChatRenderer()
        service = StoreService(config, render_chat=render)
    except (ValueError, TypeError) as exc:
        raise click.ClickException(str(exc)) from exc

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    _pace_gc(service)
    addr = service.metrics_address
    where = f"; metrics on http://{addr[0]}:{addr[1]}/metrics" if addr else ""
    assert service.daemon is not None
    click.echo(f"kvtier store serving {service.daemon.config.socket_path}{where}", err=True)
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()


GC_FREEZE_EVERY_S = 30.0


def _pace_gc(service: object) -> None:
    """The daemon's long-lived bookkeeping (index, policies, tiers' entries: about a dozen
    objects a chunk) would make every full garbage collection scan it all, 70-90 ms at 180k
    objects, stalling every client's lookup. It dies by reference counting, not in cycles:
    move it out of the collector's sight now and then (``gc.freeze``), so collections scan
    only what requests made since. The daemon's process only: the CLI owns it."""
    import gc
    import threading

    gc.freeze()

    def refreeze() -> None:
        while not stopped.wait(GC_FREEZE_EVERY_S):
            gc.freeze()

    stopped = threading.Event()
    threading.Thread(target=refreeze, name="kvtier-gc-freeze", daemon=True).start()


@store.command("stats")
@click.option("--socket", "socket_path", default=None, help="The daemon's Unix socket.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw snapshot as JSON.")
def store_stats(socket_path: str | None, as_json: bool) -> None:
    """Capacity, use, hits and what engines took, per tier, of a running daemon."""
    from kvtier.errors import DaemonUnavailable
    from kvtier.server.client import StoreClient

    client = StoreClient(socket_path)
    try:
        snap = client.stats()
    except DaemonUnavailable as exc:
        raise click.ClickException(f"no kvtier daemon at {client.socket_path}: {exc}") from exc
    finally:
        client.close()
    if as_json:
        emit_json(snap)
        return
    took: dict[str, int] = snap.get("loaded_tokens", {})  # type: ignore[assignment]
    table = Table(title=f"kvtier store at {client.socket_path}")
    for col in ("tier", "capacity", "used", "chunks", "hits", "misses", "hit ratio", "tokens taken",
                "evictions", "read", "written", "errors"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in snap["tiers"].items():  # type: ignore[union-attr]
        hits, misses = t["hits"], t["misses"]
        table.add_row(name, size_text(t["capacity_bytes"]), size_text(t["used_bytes"]), str(t["chunks"]),
                      str(hits), str(misses), f"{hits / (hits + misses):.1%}" if hits + misses else "-",
                      str(took.get(name, 0)), str(t["evictions"]), size_text(t["io"]["bytes_read"]),
                      size_text(t["io"]["bytes_written"]), str(t["io"]["errors"]))
    console = Console()
    console.print(table)
    console.print(
        f"lookups {snap['lookups']}: {snap['hit_tokens']} of {snap['lookup_tokens']} tokens found; "
        f"engines took {sum(took.values())} and already had {snap.get('had_tokens', 0)}; "
        f"engine load failures {snap.get('engine_load_failures', 0)}")
    console.print(f"clients {snap['clients']} (refused {snap.get('refused_clients', 0)}), "
                  f"pinned chunks {snap['pinned_chunks']}, writes in flight {snap['writes_in_flight']}, "
                  f"orphaned {snap.get('orphaned_writes', 0)}; prefetched {snap.get('prefetched', 0)}, "
                  f"promotions {snap['promotions']}, demotions {snap['demotions']}")
