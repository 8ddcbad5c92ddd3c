"""A timing proxy around any vLLM V1 KV connector: where each engine step's time goes.

    --kv-transfer-config '{"kv_connector": "ProfiledConnector",
        "kv_connector_module_path": "kvtier.bench.peers.connector_profile", "kv_role": "kv_both",
        "kv_connector_extra_config": {"profile_dir": "/tmp/prof",
                                      "connector": {...the wrapped connector's own config...}}}'

(:func:`kvtier.launch.profiled` writes that config.) The proxy builds the wrapped connector as vLLM's ``MultiConnector`` builds its children (a copy
of the vLLM config whose ``kv_transfer_config`` is the wrapped one), hands every call of vLLM's
connector API through to it, and times the hooks vLLM calls each step. It is standalone (stdlib
and vLLM only, never kvtier): the benchmark puts a copy of this file on the path of a peer's own
environment (LMCache's) and wraps that peer's connector the same way as kvtier's.

Per engine step it writes one JSON line to ``profile_dir/<role>-<pid>.jsonl``:

- scheduler side (vLLM's engine-core process): the time of every scheduler hook since the step
  before was built -- the lookups and allocations of this step and the outcome of the one
  before (``update_connector_output``, ``request_finished``) -- closed by ``build_connector_meta``,
  which also classifies the step: ``prefill`` when a request computes more than one token in it,
  ``decode`` when every scheduled request computes one;
- worker side: the time of every worker hook between ``bind_connector_metadata`` and
  ``clear_connector_metadata``, and that span itself (the forward pass with the hooks in it);
  the step's number and kind come with the metadata (an attribute the scheduler side sets),
  with the scheduler's pid (``scheduler``: the key, with ``step``, of the scheduler's line).

Every line carries ``t``, ``time.monotonic()`` when it was written (one clock for every
process of the host): a worker line's span began at ``t - span_s``.

When the wrapped connector has a ``profile_counters()`` method (cumulative numbers: daemon
round trips and their seconds, bytes copied), each line carries their change since the line
before of the same side (so work on background threads between steps is counted too).
The proxy's own cost (two clock reads and a dict update per hook call) is in the hook times;
each line carries ``probe_s``, what the proxy records for a hook that does nothing (measured
when it starts: the least of several rounds of timed calls of an empty function), so a report
can take it out (``hooks net of the proxy``).
Connector stats (``get_kv_connector_stats``) are not forwarded while profiling.
"""

from __future__ import annotations

import abc
import copy
import json
import os
import time
from pathlib import Path
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

__all__ = ["SCHEDULER_HOOKS", "WORKER_HOOKS", "ProfiledConnector"]

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "take_events", "on_new_request",
                   "get_external_cache_hit_sources", "has_pending_block_frees", "get_finished_count")
WORKER_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
                "build_connector_worker_meta", "clear_connector_metadata",
                "get_kv_connector_kv_cache_events", "handle_preemptions", "finish_forward",
                "get_transfer_results")
PASSED = ("register_kv_caches", "bind_kv_cache_manager", "bind_gpu_block_pool",
          "get_handshake_metadata", "set_xfer_handshake_metadata",
          "set_xfer_handshake_metadata_pp_aware", "set_host_xfer_buffer_ops", "get_mem_pool_context",
          "reset_capture_state", "reset_cache", "has_pending_push_work",
          "get_loaded_kv_cache_group_ids", "register_finished_partial_tail",
          "unregister_kv_caches", "restore_kv_caches", "may_load_async")
"""Calls handed through untimed (set-up, or not made per step)."""
STEP_ATTR = "_kvtier_profile_step"


def _inner_of(outer):  # type: ignore[no-untyped-def]
    """(class, transfer config) of the wrapped connector, from the proxy's transfer config."""
    spec = dict((outer.kv_connector_extra_config or {}).get("connector") or {})
    if not spec.get("kv_connector"):
        raise ValueError("ProfiledConnector: kv_connector_extra_config.connector must name the "
                         "connector to profile (its own kv-transfer-config)")
    spec.setdefault("kv_role", outer.kv_role)
    spec.setdefault("engine_id", outer.engine_id)
    config = KVTransferConfig(**spec)
    return KVConnectorFactory.get_connector_class(config), config


def _inner(vllm_config):  # type: ignore[no-untyped-def]
    """(class, vLLM config) of the wrapped connector."""
    inner_cls, config = _inner_of(vllm_config.kv_transfer_config)
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = config
    return inner_cls, inner


def _kind(scheduler_output) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    tokens = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
    total = sum(tokens.values())
    if not total:
        return "idle", 0
    return ("prefill" if any(n > 1 for n in tokens.values()) else "decode"), total


class ProfiledConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cls, inner_config = _inner(vllm_config)
        self.inner = cls(inner_config, role, kv_cache_config)
        # the wrapped connector's settings are what vLLM's scheduler reads (e.g. a load failure
        # policy the connector sets for itself)
        self._kv_transfer_config.kv_load_failure_policy = inner_config.kv_transfer_config.kv_load_failure_policy
        out = Path(self._kv_transfer_config.kv_connector_extra_config["profile_dir"])
        out.mkdir(parents=True, exist_ok=True)
        self._side = "worker" if role == KVConnectorRole.WORKER else "scheduler"
        self._out = open(out / f"{self._side}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
        self._hooks: dict[str, list[float]] = {}
        self._counters = self._read_counters()
        self._step = 0
        self._bound: tuple[int, str, int] | None = None
        self._began = 0.0
        self._probe_s = self._calibrate()

    # -- bookkeeping ---------------------------------------------------------------------------
    def _read_counters(self) -> dict[str, float]:
        read = getattr(self.inner, "profile_counters", None)
        return dict(read()) if callable(read) else {}

    def _timed(self, name: str, fn, *args: Any, **kwargs: Any) -> Any:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            slot = self._hooks.get(name)
            if slot is None:
                slot = self._hooks[name] = [0.0, 0]
            slot[0] += time.perf_counter() - t0
            slot[1] += 1

    def _calibrate(self, calls: int = 2000, rounds: int = 7) -> float:
        """Seconds the proxy records per call of a hook that does nothing (the least of
        ``rounds`` rounds: the others were interrupted)."""
        def nothing() -> None:
            return None

        best = float("inf")
        for _ in range(rounds):
            self._hooks = {}
            for _ in range(calls):
                self._timed("_probe", nothing)
            best = min(best, self._hooks["_probe"][0] / calls)
        self._hooks = {}
        return best

    def _emit(self, record: dict[str, Any]) -> None:
        record["probe_s"] = self._probe_s
        record["t"] = round(time.monotonic(), 6)  # when written (CLOCK_MONOTONIC: one clock for
        # every process of the host, so a run's window and the gaps between steps can be read off)
        now = self._read_counters()
        record["counters"] = {k: v - self._counters.get(k, 0) for k, v in now.items()}
        record["hooks"] = {k: [round(s, 7), int(n)] for k, (s, n) in self._hooks.items()}
        self._counters, self._hooks = now, {}
        self._out.write(json.dumps(record) + "\n")

    # -- the hooks whose boundaries make a step ------------------------------------------------
    def build_connector_meta(self, scheduler_output):  # type: ignore[no-untyped-def]
        meta = self._timed("build_connector_meta", self.inner.build_connector_meta, scheduler_output)
        kind, tokens = _kind(scheduler_output)
        if kind != "idle":
            self._step += 1
            try:
                setattr(meta, STEP_ATTR, (self._step, kind, os.getpid()))
            except AttributeError:  # (a metadata class with slots: the worker's line has no kind)
                pass
            self._emit({"side": "scheduler", "pid": os.getpid(), "step": self._step, "kind": kind, "tokens": tokens,
                        "requests": len(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})})
        return meta

    def bind_connector_metadata(self, connector_metadata) -> None:  # type: ignore[no-untyped-def]
        super().bind_connector_metadata(connector_metadata)
        self._bound = getattr(connector_metadata, STEP_ATTR, (0, "unknown", 0))
        self._hooks = {}  # (counters run on from the step before: background work counts too)
        self._began = time.perf_counter()
        self._timed("bind_connector_metadata", self.inner.bind_connector_metadata, connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._timed("clear_connector_metadata", self.inner.clear_connector_metadata)
        super().clear_connector_metadata()
        if self._bound is not None:
            step, kind, scheduler = self._bound
            self._bound = None
            self._emit({"side": "worker", "step": step, "kind": kind, "scheduler": scheduler,
                        "span_s": round(time.perf_counter() - self._began, 7)})

    def get_kv_connector_stats(self):  # type: ignore[no-untyped-def]
        return None

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            self._out.close()

    # -- class-level calls: the wrapped connector's class answers ------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):  # type: ignore[no-untyped-def]
        inner_cls, inner_config = _inner(vllm_config)
        return inner_cls.get_required_kvcache_layout(inner_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:  # type: ignore[no-untyped-def]
        """(vLLM 0.33+) whether the wrapped connector follows sleep mode: the proxy hands its
        KV cache (un)registrations through."""
        inner_cls, inner_config = _inner_of(kv_transfer_config)
        answer = getattr(inner_cls, "supports_sleep_mode", None)
        return bool(answer(inner_config)) if answer is not None else False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):  # type: ignore[no-untyped-def]
        """(vLLM 0.34) how the wrapped connector reaches the KV cache."""
        inner_cls, inner_config = _inner_of(kv_transfer_config)
        return inner_cls.kv_cache_access(inner_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        spec = dict(extra_config.get("connector") or {})
        inner_cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**spec))
        return inner_cls.requires_piecewise_for_cudagraph(spec.get("kv_connector_extra_config") or {})

    @property
    def requires_kv_delivery(self) -> bool:
        return bool(self.inner.requires_kv_delivery)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return bool(self.inner.supports_divergent_local_hybrid_hits)


def _timed_hook(name: str):  # type: ignore[no-untyped-def]
    def hook(self: ProfiledConnector, *args: Any, **kwargs: Any) -> Any:
        return self._timed(name, getattr(self.inner, name), *args, **kwargs)

    hook.__name__ = name
    return hook


def _passed(name: str):  # type: ignore[no-untyped-def]
    def call(self: ProfiledConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    call.__name__ = name
    return call


for _name in (*SCHEDULER_HOOKS, *WORKER_HOOKS):
    if _name not in ProfiledConnector.__dict__:
        setattr(ProfiledConnector, _name, _timed_hook(_name))
for _name in PASSED:
    setattr(ProfiledConnector, _name, _passed(_name))
abc.update_abstractmethods(ProfiledConnector)  # the hooks set above are its own now
