"""vLLM's offline engine (``vllm.LLM``) with the connector.

A server's engine loop keeps stepping while the connector saves finished requests in the
background (vLLM holds their blocks until the worker reports the save done), so the next turn of
a conversation finds the whole previous one. ``LLM.generate`` returns as soon as its requests
have produced their outputs, before those saves have run: call :func:`drain` after it when the
next request must find them (a multi-turn chat driven offline, a test).

The same held blocks keep vLLM from resetting its prefix cache, and vLLM does not wait for them
where nothing steps the engine meanwhile (in process, ``LLM.sleep`` and
``LLM.reset_prefix_cache(reset_running_requests=True)`` raise "Failed to reset KV cache"): after
new weights call :func:`reset_cache`; in process, :func:`drain` before ``LLM.sleep``.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

RETRY_S = 0.02
"""The pause between two tries of a reset vLLM could not do yet."""


def _scheduler(llm):  # type: ignore[no-untyped-def]
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise ValueError("drain needs vLLM's in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return core, core.scheduler


def drain(llm, timeout_s: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    """Step ``llm``'s engine until no finished request waits for its save (nor a save for the
    ranks' verdict); False on timeout."""
    core, scheduler = _scheduler(llm)
    deadline = time.monotonic() + timeout_s
    connector = getattr(scheduler, "connector", None)
    while scheduler.has_finished_requests() or scheduler.finished_req_ids \
            or (connector is not None and connector.has_pending_push_work()):  # (ranks' votes)
        if time.monotonic() > deadline:
            return False
        core.step()
        time.sleep(0.001)
    return True


def reset_cache(llm, timeout_s: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    """Reset ``llm``'s prefix cache and kvtier's (new weights: no load after this comes from a
    chunk saved before), whatever kvtier is still saving; False if vLLM could not reset its own
    within ``timeout_s`` (kvtier's part is then done, and a later reset completes it).

    vLLM resets its own cache first and cannot while any block is held -- by a finished
    request whose save to kvtier still runs, among others -- and an in-process engine does not
    step meanwhile. In process, the saves are drained first (:func:`drain`), then requests still
    running are preempted (computed again, under the new weights, when they resume) and both
    caches reset. A multi-process engine core steps on its own: the reset is tried until vLLM's
    part succeeds -- once the saves, and any request still running, are done."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    deadline = time.monotonic() + timeout_s
    warned = False
    while True:
        if core is None:
            if llm.reset_prefix_cache(reset_connector=True):
                return True
        elif drain(llm, max(0.0, deadline - time.monotonic())):
            try:
                return bool(llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True))
            except RuntimeError as exc:  # a block still held: a load between steps, say
                if not warned:
                    log.warning("kvtier: vLLM could not reset its prefix cache yet (retrying): %s", exc)
                    warned = True
                core.step()
        if time.monotonic() > deadline:
            if core is not None:  # kvtier's part at least (vLLM calls it when it does not raise)
                llm.reset_prefix_cache(reset_connector=True)
            return False
        time.sleep(RETRY_S)
