"""Two machines, one remote tier, a vLLM server on each: a chat whose turns alternate between
them computes only its new tokens (and at most one block of history) on every turn after the
first, with vLLM's own replies.

Each "machine" is a store daemon of its own (its own DRAM, its own SSD, its own Unix socket)
with a ``[remote]`` tier shared with the other (write-through: what a daemon saves is uploaded
at once), and a real ``vllm serve`` process (vLLM's OpenAI server module) on that daemon, driven
through the official ``openai`` client. The two servers start once for the module; each remote
backend (Valkey standalone, Valkey cluster, Mooncake Store, real servers on loopback) gets a
fresh pair of daemons at the same two socket paths, to which the connectors reconnect.

Every cached token is kvtier's: vLLM's own prefix cache is off. The reference ("vLLM alone") is
the same server with the request opted out of kvtier (``kv_transfer_params={"kvtier": "skip"}``:
no lookup, no save). Prompts are token ids through the completions API; a reply's token ids come
back with vLLM's ``return_token_ids``, and ``ignore_eos`` makes every reply ``MAX_TOKENS`` long,
so that turn t+1's prompt is exactly turn t's prompt, its reply and new tokens.

Namespaces hold across machines: a request with another ``cache_salt`` on the other machine
hits nothing (with the same salt it does), nor does a daemon configured for another tenant.

A gap, reported as an expected failure until it is closed: the partial last chunk of a turn
(whole vLLM blocks past its last full chunk) is found only on the machine that saved it, so a
turn on the other machine computes up to a chunk of history again, not at most a block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvtier.bench import servers
from kvtier.bench.servers import free_port
from kvtier.errors import DaemonUnavailable
from tests.remote_servers import unique_prefix

from ..daemon_process import KVTIER, DaemonProcess, wait_for_socket
from .test_vllm_connector import BLOCK, CHUNK, prompt
from .test_vllm_serve import SERVE, wait_healthy

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
NEW_TOKENS = 40
"""Tokens each later turn adds after the last reply (the user's next message)."""
CHUNK_BYTES = 2 * 2 * 2 * CHUNK * 32 * 4  # the tiny model: layers x (K,V) x kv heads x tokens x dim x fp32
SKIP = {"kv_transfer_params": {"kvtier": "skip"}}


# -- the machines -------------------------------------------------------------------------------
class RemoteDaemon(DaemonProcess):
    """A machine's store daemon: DRAM, SSD (write-through) and the shared ``[remote]`` tier."""

    def __init__(self, run: Path, socket_path: Path, remote: list[str], tenant: str = "") -> None:
        run.mkdir(parents=True)
        config = run / "kvtier.toml"
        config.write_text("\n".join([
            f'socket = "{socket_path}"', "write_through = true", f'tenant = "{tenant}"',
            "[host]", f"capacity_bytes = {64 * CHUNK_BYTES}", f"extent_bytes = {CHUNK_BYTES}",
            "[disk]", f'path = "{run / "ssd"}"', 'capacity_bytes = "64MiB"',
            *remote,
        ]) + "\n")
        super().__init__(config, socket_path, run / "daemon.log")

    def stats(self) -> dict:
        """The daemon's stats, asked again while it does not answer (for a few seconds): its
        stats read the remote tier's use from the server, under the daemon's lock, so a slow
        remote server holds them up (and a stats call every few ms holds the daemon up)."""
        deadline = time.monotonic() + 15
        while True:
            try:
                return super().stats()
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def launch(self) -> None:
        """Start the process; :meth:`ready` waits for it to listen (two start side by side)."""
        with open(self.log, "a") as err:
            self.proc = subprocess.Popen([KVTIER, "store", "serve", "--config", str(self.config)],
                                         stderr=err, text=True)

    def ready(self) -> None:
        assert self.proc is not None
        wait_for_socket(self.socket, self.proc)


def remote_table(backend: str, request: pytest.FixtureRequest) -> list[str]:
    """The ``[remote]`` TOML lines of ``backend``, its server started by its fixture (skipped
    when the server binary is missing), under a key prefix of this test's own."""
    prefix = unique_prefix()
    # timeout_s: this 2-core machine runs two vLLM servers and other tests besides; with the
    # default 1 s, an upload to the cluster once counted as failed under load ("reservation ...
    # expired before its commit": a publish sent again after a timeout, it seems). Below the
    # 5 s a client of the daemon waits: a stalled server holds the daemon's stats up (see stats)
    if backend == "mooncake":
        mc = request.getfixturevalue("mooncake_shared")
        return ["[remote]", 'backend = "mooncake"', 'write = "through"', "[remote.mooncake]",
                f'master_address = "{mc.master_address}"', 'capacity_bytes = "64MiB"', f'prefix = "{prefix}"',
                "timeout_s = 3"]
    if backend == "valkey-cluster":
        addresses, cluster = request.getfixturevalue("valkey_cluster").addresses, True
    else:
        addresses, cluster = [request.getfixturevalue("valkey_standalone").address], False
    return ["[remote]", 'backend = "valkey"', 'write = "through"', "[remote.valkey]",
            f"addresses = {json.dumps(addresses)}", f"cluster = {'true' if cluster else 'false'}",
            'capacity_bytes = "64MiB"', f'prefix = "{prefix}"', "timeout_s = 3"]


@dataclass
class Reply:
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int


class Server:
    """A ``vllm serve`` process with the kvtier connector on the daemon socket ``socket_path``."""

    def __init__(self, model_dir: Path, socket_path: Path, log: Path, core: int) -> None:
        self.port = free_port()
        self.log_path = log
        ktc = {
            "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.engines.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            # retry_s: the daemons restart under the server for every backend; reconnect at once
            "kv_connector_extra_config": {"socket": str(socket_path), "chunk_tokens": CHUNK, "retry_s": 0.05},
        }
        # a core each, as `kvtier bench serve --instances 2` gives them
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))}
        self._log = open(log, "w")  # noqa: SIM115 - the server writes it until the module ends
        self.proc = subprocess.Popen(
            [*SERVE, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "2048",
             "--seed", "0", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
             "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(ktc)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused",
                                    timeout=120)

    def wait_ready(self, deadline: float) -> None:
        wait_healthy(self.proc, self.port, self.log_path, deadline, poll_s=0.5)

    def complete(self, tokens: list[int], **extra: object) -> Reply:
        """Greedy, ``MAX_TOKENS`` long; ``extra`` goes in the request body (``cache_salt``,
        ``kv_transfer_params``). The reply's token ids come with vLLM's ``return_token_ids``."""
        out = self.client.completions.create(
            model="tiny", prompt=tokens, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
        details = out.usage.prompt_tokens_details
        return Reply(list(out.choices[0].token_ids), out.usage.prompt_tokens,
                     details.cached_tokens if details is not None else 0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@dataclass
class Machines:
    a: Server
    b: Server
    sockets: tuple[Path, Path]
    chat: list[list[int]]
    """The chat's prompts, turn by turn, made of the replies vLLM alone gives."""
    replies: list[list[int]]


def chat_turns(first: list[int], n: int,
               reply_of: Callable[[list[int]], list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` turns' prompts and replies: each prompt is the last one, its reply and new tokens."""
    prompts, replies = [first], []
    for t in range(n):
        replies.append(reply_of(prompts[-1]))
        if t + 1 < n:
            prompts.append(prompts[-1] + replies[-1] + prompt(NEW_TOKENS, 60 + t))
    return prompts, replies


@pytest.fixture(scope="module")
def machines(tiny_model_dir, tmp_path_factory) -> Iterator[Machines]:
    tmp = tmp_path_factory.mktemp("two")
    sockets = (tmp / "a.sock", tmp / "b.sock")
    servers: list[Server] = []
    try:
        for i, sock in enumerate(sockets):  # both start at once; no daemon yet: they reconnect
            servers.append(Server(tiny_model_dir, sock, tmp / f"vllm-{'ab'[i]}.log", core=i))
        deadline = time.monotonic() + 600  # a ceiling: on a loaded 2-core machine this took 280 s
        for s in servers:
            s.wait_ready(deadline)
        a, b = servers

        def reply_of(tokens: list[int]) -> list[int]:
            got = a.complete(tokens, **SKIP)
            assert got.cached_tokens == 0 and len(got.token_ids) == MAX_TOKENS
            return got.token_ids

        chat, replies = chat_turns(prompt(300, 50), 4, reply_of)
        yield Machines(a, b, sockets, chat, replies)
    finally:
        for s in servers:
            s.stop()


# -- what the daemons did -----------------------------------------------------------------------
def saved_by(turn_tokens: int) -> tuple[int, int]:
    """(full chunks, blocks of a partial chunk) a finished turn saves: its prompt and every
    reply token but the last (never fed back to the model)."""
    computed = turn_tokens + MAX_TOKENS - 1
    return computed // CHUNK, (computed % CHUNK) // BLOCK


def settle(daemon: RemoteDaemon, saved_at_least: int) -> dict:
    """Wait until ``daemon`` has saved ``saved_at_least`` chunks in all (a finished request's
    last chunks are saved after its reply) and uploaded every one."""
    last: list[dict] = []

    def done() -> bool:
        last[:] = [daemon.stats()]
        up = last[0]["uploads"]
        return last[0]["saved_chunks"] >= saved_at_least and up["queued"] == up["uploaded"] + up["failed"]

    deadline = time.monotonic() + 20
    while not done():
        what = f"{daemon.log.parent.name}: not {saved_at_least} chunks saved and uploaded"
        assert time.monotonic() < deadline, (what, {k: last[0][k] for k in FIGURES})
        time.sleep(0.1)
    assert last[0]["uploads"]["failed"] == 0 and last[0]["uploads"]["overflow"] == 0, last[0]["uploads"]
    return last[0]


FIGURES = ("tiers", "loaded_tokens", "saved_chunks", "promotions", "uploads", "lookups", "hit_tokens")


def remote_tier(snap: dict) -> str:
    (name,) = set(snap["tiers"]) - {"host", "disk"}
    return name


@pytest.fixture
def daemons(machines) -> Iterator[list[RemoteDaemon]]:
    """The daemons a test starts, stopped at its end (before the vLLM servers)."""
    started: list[RemoteDaemon] = []
    yield started
    for d in started:
        d.stop()


def start(started: list[RemoteDaemon], *made: RemoteDaemon) -> None:
    """Start ``made`` at once, then wait for each to listen."""
    started.extend(made)
    for d in made:
        d.launch()
    for d in made:
        d.ready()


WARM_UP = 2 * CHUNK + BLOCK
"""A warm-up prompt: two full chunks and a partial one, saved on both of a connector's worker
connections (the step's and the finished requests')."""


def warm_up(pairs: list[tuple[Server, RemoteDaemon]], salt: int) -> None:
    """Bring each engine's connector onto its (new) daemon. A daemon that restarted at the same
    socket leaves each connection of the connector broken until its next call finds out: a
    lookup is sent again on a new connection, but a save's reserve (a lease) is not, and that
    save is lost (logged "reserve failed ... serving as cache misses", then "is back"). So
    prompts go to each engine until one of them is saved whole (the engines side by side)."""
    full, tail = saved_by(WARM_UP)

    def one(i: int, server: Server, daemon: RemoteDaemon) -> None:
        for attempt in range(8):  # prompts of their own: two uploads of one chunk race in Mooncake
            saved = daemon.stats()["saved_chunks"]
            server.complete(prompt(WARM_UP, 900 + 100 * salt + 10 * i + attempt))
            deadline = time.monotonic() + 0.5  # a lost save never comes: try another prompt
            while daemon.stats()["saved_chunks"] < saved + full + tail and time.monotonic() < deadline:
                time.sleep(0.1)
            if daemon.stats()["saved_chunks"] == saved + full + tail:
                settle(daemon, 0)  # its uploads done too
                return
        pytest.fail(f"the connector never saved onto {daemon.socket}")

    with ThreadPoolExecutor(len(pairs)) as pool:
        for done in [pool.submit(one, i, *pair) for i, pair in enumerate(pairs)]:
            done.result()


def dump_logs(daemons: list[RemoteDaemon], servers: list[Server]) -> None:
    for d in daemons:
        print(f"--- {d.log}:\n{d.log.read_text()[-3000:]}", file=sys.stderr)
    for s in servers:
        lines = [line for line in s.log_path.read_text().splitlines() if "kvtier" in line]
        print(f"--- kvtier in {s.log_path}:\n" + "\n".join(lines[-20:]), file=sys.stderr)


# -- the story ----------------------------------------------------------------------------------
def missing(binary: Callable[[], str]) -> str:
    """Why a server binary is missing ("" if it is not): checked before the vLLM servers start,
    so that a backend the fixtures would skip costs no engine start."""
    try:
        binary()
    except servers.ServerError as exc:
        return str(exc)
    return ""


def backend_param(name: str, why: str) -> object:
    return pytest.param(name, marks=pytest.mark.skipif(bool(why), reason=why))


BACKENDS = [
    backend_param("valkey", missing(servers.valkey_server_binary)),
    backend_param("valkey-cluster", missing(servers.valkey_server_binary)),
    backend_param("mooncake", missing(lambda: servers.mooncake_binary("mooncake_master"))),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_machines_over_one_remote_tier(backend, machines, daemons, tmp_path, request):
    remote = remote_table(backend, request)
    a = RemoteDaemon(tmp_path / "a", machines.sockets[0], remote)
    b = RemoteDaemon(tmp_path / "b", machines.sockets[1], remote)
    try:
        start(daemons, a, b)
        warm_up([(machines.a, a), (machines.b, b)], 0)
        recomputed = alternate(machines, a, b)
        salts_and_tenants(machines, a, b, daemons, remote, tmp_path)
    except (AssertionError, pytest.fail.Exception):
        dump_logs(daemons, [machines.a, machines.b])
        raise
    # every later turn, on the machine that did not save it, found the last turn's partial
    # chunk in the remote tier too: at most one block of history computed again
    assert max(recomputed) <= BLOCK, recomputed


def alternate(machines: Machines, a: RemoteDaemon, b: RemoteDaemon) -> list[int]:
    """The chat, turn 1 on A, then B, A, B. Returns the tokens of history each later turn
    computed again (at most one block is the goal; at most a chunk is asserted)."""
    server = {a: machines.a, b: machines.b}
    saved = {d: d.stats()["saved_chunks"] for d in (a, b)}
    recomputed = []
    for t, tokens in enumerate(machines.chat):
        here = (a, b)[t % 2]
        before = here.stats()
        got = server[here].complete(tokens)
        assert got.token_ids == machines.replies[t], t  # vLLM's own reply
        assert got.prompt_tokens == len(tokens)
        full, tail = saved_by(len(tokens))
        if t == 0:
            assert got.cached_tokens == 0
            saved[here] += full + tail
        else:
            history = len(machines.chat[t - 1]) + MAX_TOKENS
            recomputed.append(got.prompt_tokens - got.cached_tokens - (len(tokens) - history))
            assert recomputed[-1] <= CHUNK, (t, got)  # every full chunk of history came from kvtier
            had_full, _ = saved_by(len(machines.chat[t - 1]))
            saved[here] += full - had_full + tail
        snap = settle(here, saved[here])
        if t > 0:
            # what the other machine wrote came up from the remote tier into this one's DRAM
            name = remote_tier(snap)
            took = {k: v - before["loaded_tokens"].get(k, 0) for k, v in snap["loaded_tokens"].items()}
            assert sum(took.values()) == got.cached_tokens, (t, took, got)
            fetched = snap["tiers"][name]["io"]["hits"]  # chunks read from the remote tier, ever
            assert fetched > before["tiers"][name]["io"]["hits"], (t, snap["tiers"][name])
            # each of them staged in DRAM (nothing was evicted), beside what this machine saved
            assert snap["tiers"]["host"]["chunks"] == snap["saved_chunks"] + fetched, (t, snap["tiers"])
    # the reference really is vLLM alone: opted out, nothing is looked up where everything is held
    again = machines.b.complete(machines.chat[-1], **SKIP)
    assert again.cached_tokens == 0 and again.token_ids == machines.replies[-1]
    return recomputed


def salts_and_tenants(machines: Machines, a: RemoteDaemon, b: RemoteDaemon, started: list[RemoteDaemon],
                      remote: list[str], tmp_path: Path) -> None:
    """A salted prompt machine A computed: machine B hits it with the same salt only; and a
    daemon of another tenant in B's place hits nothing of it."""
    tokens, want = machines.chat[0], machines.replies[0]
    full, tail = saved_by(len(tokens))
    saved = a.stats()["saved_chunks"]
    first = machines.a.complete(tokens, cache_salt="alice")  # A holds the prompt, but unsalted
    assert (first.cached_tokens, first.token_ids) == (0, want)
    settle(a, saved + full + tail)
    other = machines.b.complete(tokens, cache_salt="mallory")
    assert (other.cached_tokens, other.token_ids) == (0, want)
    same = machines.b.complete(tokens, cache_salt="alice")  # the salt travels with the chunks
    assert same.cached_tokens >= full * CHUNK and same.token_ids == want
    # machine B again, now with a daemon of another tenant (its DRAM and SSD empty): what tenant
    # "" wrote to the shared tier is not its own, salted or not
    b.stop()
    beta = RemoteDaemon(tmp_path / "beta", machines.sockets[1], remote, tenant="beta")
    start(started, beta)
    warm_up([(machines.b, beta)], 1)
    before = beta.stats()
    for salt in ("alice", None):
        got = machines.b.complete(tokens, **({"cache_salt": salt} if salt else {}))
        assert (got.cached_tokens, got.token_ids) == (0, want), salt
    snap = beta.stats()
    name = remote_tier(snap)
    asked = snap["tiers"][name]["misses"] - before["tiers"][name]["misses"]
    assert snap["lookups"] >= before["lookups"] + 2 and asked > 0, snap  # it asked the remote tier
    assert snap["tiers"][name]["hits"] == 0 and snap["tiers"][name]["io"]["hits"] == 0, snap  # found nothing
