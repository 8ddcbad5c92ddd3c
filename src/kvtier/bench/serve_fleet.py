"""``kvtier bench serve --instances N``: one configuration served by N vLLM instances behind a
router of the benchmark's own.

Each instance is its own OpenAI server process with the same flags, KV pool and
``VLLM_CPU_KVCACHE_SPACE`` a single instance gets, and its own share of the cores
(:func:`~kvtier.bench.serve_routes.cpu_binds`: the cores of ``cpu_bind`` split evenly, in
order, the same in every configuration; on two cores with two instances, instance i runs on
core i). For ``kvtier`` each instance has a store daemon of its own -- its own machine: the DRAM
and SSD budgets one instance gets -- and every daemon shares one remote tier, a Valkey server
this module starts on 127.0.0.1 and stops at the end (write-through: a chunk one daemon saves is
uploaded at once, and another daemon's lookup that misses locally finds it there). ``vllm`` gets
the same routing over N plain servers.

The router lives in the chat client (:func:`kvtier.bench.chat_client.run_conversations`): each
turn's request goes to ``ROUTES[route](conversation, turn, N)``
(:mod:`kvtier.bench.serve_routes`). ``sticky`` keeps a conversation on one instance (``c % N``);
``round-robin`` moves every turn to the next one (``(c + t) % N``), so each later turn lands
where its history was never computed.

Order: Valkey, then each instance's daemon and vLLM; everything is stopped in reverse, also on
failure. Figures of a fleet's run: the daemons' counters and vLLM's preemptions are summed over
the instances, the pool is one instance's.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.bench.chat_client import run_conversations, warm_up
from kvtier.bench.serve_report import Run
from kvtier.bench.serve_routes import cpu_binds, route_of
from kvtier.bench.serve_stacks import (
    _POOL_LOG,
    SERVED_NAME,
    RequestFailed,
    _kvtier_delta,
    budgets,
    preemptions,
    stack_config,
)
from kvtier.bench.servers import ServerError, ServerProcess, ValkeyServer
from kvtier.errors import DaemonUnavailable
from kvtier.launch import LOG_TAIL_CHARS, ChildDied, ServeStack, StackConfig, kv_transfer_config
from kvtier.server.client import StoreClient

if TYPE_CHECKING:
    from kvtier.bench.serve_config import ServeBenchConfig
    from kvtier.bench.serve_workload import Workload

__all__ = ["FleetDaemon", "run_fleet"]


def _store_toml(path: Path, socket: str, dram: int, ssd_path: Path, ssd: int, policy: str | None,
                valkey_address: str, remote_bytes: int) -> Path:
    def q(text: object) -> str:  # a TOML basic string (JSON's escapes are TOML's)
        return json.dumps(str(text))

    lines = [f"socket = {q(socket)}"] + ([f"policy = {q(policy)}"] if policy is not None else [])
    lines += ["[host]", f"capacity_bytes = {dram}",
              "[disk]", f"path = {q(ssd_path)}", f"capacity_bytes = {ssd}",
              "[remote]", 'backend = "valkey"', 'write = "through"',  # others find a chunk at once
              "[remote.valkey]", f"addresses = [{q(valkey_address)}]", f"capacity_bytes = {remote_bytes}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


class FleetDaemon:
    """One instance's kvtier store daemon, its config a TOML file with the shared ``[remote]``
    (started here, not by ``ServeStack``: its ``StoreSpec`` has no remote tier); its vLLM is a
    store-less stack whose connector is kvtier's, on this daemon's socket."""

    def __init__(self, workdir: Path, socket: str, config_path: Path) -> None:
        self.socket = socket
        argv = [sys.executable, "-c", "from kvtier.cli import main; main(prog_name='kvtier')",
                "store", "serve", "--config", str(config_path)]
        self.process = ServerProcess("daemon", argv, workdir, self._answers)

    def _answers(self) -> bool:
        try:
            self.stats()
            return True
        except DaemonUnavailable:
            return False

    def start(self) -> FleetDaemon:
        """Raises :class:`ChildDied` if the daemon does not answer within a minute."""
        try:
            self.process.start(timeout_s=60.0)
        except ServerError:
            raise self._died() from None
        return self

    def _died(self) -> ChildDied:
        proc = self.process.proc
        tail = self.process.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        return ChildDied("daemon", proc.returncode if proc is not None else None, tail)

    def check(self) -> None:
        """Raise :class:`ChildDied` if the daemon has exited."""
        if not self.process.running:
            raise self._died()

    def stats(self) -> dict[str, object]:
        client = StoreClient(self.socket, timeout_s=5.0, retry_s=0.05)
        try:
            return client.stats()
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM (the daemon flushes its uploads), SIGKILL after a grace; a killed daemon's
        arena is removed from /dev/shm by claiming its socket, as ``ServeStack`` does."""
        from kvtier.server.runtime import SocketClaim

        started = self.process.proc is not None
        self.process.stop()
        if started:
            try:
                SocketClaim(self.socket).release()
            except (ValueError, OSError):  # the socket is gone with a clean stop, or taken
                pass


def _delta(before: list[dict], after: list[dict]) -> dict[str, int]:  # type: ignore[type-arg]
    """The daemons' counters over the run, summed (tiers' hits and tokens taken, uploads)."""
    out: dict[str, int] = {}
    for b, a in zip(before, after, strict=True):
        for key, value in _kvtier_delta(b, a).items():
            out[key] = out.get(key, 0) + value
        for key in ("uploaded", "failed", "overflow"):
            got = int(a.get("uploads", {}).get(key, 0)) - int(b.get("uploads", {}).get(key, 0))
            out[f"uploads_{key}"] = out.get(f"uploads_{key}", 0) + got
    return out


@contextlib.contextmanager
def _fleet(name: str, config: ServeBenchConfig, model_dir: Path, work: Workload, tmp: Path,
           profile_dir: Path | None) -> Iterator[tuple[list[ServeStack], list[FleetDaemon]]]:
    """Start the fleet (Valkey and the daemons for ``kvtier``), yield its stacks and daemons,
    stop it all on leaving."""
    binds = cpu_binds(config.cpu_bind, config.instances)
    dram, ssd = budgets(config, work)
    stacks: list[ServeStack] = []
    daemons: list[FleetDaemon] = []
    valkey = ValkeyServer(tmp / name / "valkey") if name == "kvtier" else None
    sockets = tempfile.TemporaryDirectory(prefix="kvtier-fleet-", dir="/tmp")
    try:
        if valkey is not None:
            valkey.start()
        for i, bind in enumerate(binds):
            base = stack_config(name, config, model_dir, work, tmp, None,
                                profile_dir / f"instance{i}" if profile_dir else None)
            run = tmp / name / f"instance{i}"
            vllm = replace(base.vllm, env={**base.vllm.env, "VLLM_CPU_OMP_THREADS_BIND": bind})
            if valkey is not None:
                socket = str(Path(sockets.name) / f"kvtier{i}.sock")  # short: a socket path has ~100 bytes
                toml = _store_toml(run / "store.toml", socket, dram, run / "ssd", ssd, config.policy,
                                   valkey.address, ssd)
                daemon = FleetDaemon(run, socket, toml)
                daemons.append(daemon)  # (before it starts: one interrupted mid-start is stopped too)
                daemon.start()
                vllm = replace(vllm, connector=kv_transfer_config(socket, config.chunk_tokens, config.load_async))
            stack = ServeStack(StackConfig(vllm=vllm, store=None, workdir=str(run), grace_s=base.grace_s))
            stacks.append(stack)
            stack.start()
        yield stacks, daemons
    finally:
        # each stopped on its own: one that fails to stop (or a second Ctrl-C in one) leaves
        # none of the others running
        with contextlib.ExitStack() as stop:
            stop.callback(sockets.cleanup)
            if valkey is not None:
                stop.callback(valkey.stop)
            for daemon in daemons:
                stop.callback(daemon.stop)
            for stack in stacks:
                stop.callback(stack.stop)


def run_fleet(name: str, repeat: int, config: ServeBenchConfig, model_dir: Path, work: Workload,
              tmp: Path, profile_dir: Path | None, progress: Callable[[str], None]) -> Run:
    """One run of configuration ``name`` over ``config.instances`` instances."""
    n = config.instances
    progress(f"{name} (run {repeat + 1} of {config.repeats}): starting {n} vLLM instances"
             f"{', their kvtier daemons and the shared Valkey' if name == 'kvtier' else ''}")
    with _fleet(name, config, model_dir, work, tmp, profile_dir) as (stacks, daemons):
        urls = [f"{s.url}/v1" for s in stacks]
        try:
            for url in urls:
                warm_up(url, SERVED_NAME)
            before = [d.stats() for d in daemons]
            preempted = [preemptions(s.url) for s in stacks]
            progress(f"{name}: {len(work.plans)} conversations of {config.turns} turns, "
                     f"{config.route} over {n} instances")
            t0, since = time.perf_counter(), time.monotonic()  # (the profile's clock: time.monotonic)
            records = run_conversations(urls, SERVED_NAME, work.plans, in_flight=config.in_flight,
                                        think_s=config.think_s, router=route_of(config.route, n))
            wall, until = time.perf_counter() - t0, time.monotonic()
        except Exception as exc:  # the servers' logs say why; they go with the fleet
            logs = "\n".join(f"-- instance {i}:\n{s.log_text('vllm')[-2000:]}" for i, s in enumerate(stacks))
            raise RequestFailed(f"{name}: a request failed ({exc}); the end of vLLM's logs:\n{logs}") from exc
        for stack in stacks:
            stack.check()
        for daemon in daemons:
            daemon.check()
        after = [preemptions(s.url) for s in stacks]
        counts = [a - b for a, b in zip(after, preempted, strict=True) if a is not None and b is not None]
        delta = _delta(before, [d.stats() for d in daemons]) if daemons else None
        found = _POOL_LOG.findall(stacks[0].log_text("vllm"))
        pool = int(found[-1].replace(",", "")) if found else None
    profile = None
    if profile_dir is not None and name != "vllm":
        from kvtier.bench.peers.profile_report import summarize_profile

        profile = summarize_profile(profile_dir / "instance0", since, until)  # step numbers are per instance
    return Run(name, repeat, records, wall, pool, delta, profile,
               sum(counts) if len(counts) == n else None)
