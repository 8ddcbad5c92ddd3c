"""vLLM's in-process engine (``vllm.LLM``) with the connector.

A server's engine loop keeps stepping while the connector saves finished requests in the
background (vLLM holds their blocks until the worker reports the save done), so the next turn of
a conversation finds the whole previous one. ``LLM.generate`` returns as soon as its requests
have produced their outputs, before those saves have run: call :func:`drain` after it when the
next request must find them (a multi-turn chat driven offline, a test).
"""

from __future__ import annotations

import time


def _scheduler(llm):  # type: ignore[no-untyped-def]
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise ValueError("drain needs vLLM's in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return core, core.scheduler


def drain(llm, timeout_s: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    """Step ``llm``'s engine until no finished request waits for its save; False on timeout."""
    core, scheduler = _scheduler(llm)
    deadline = time.monotonic() + timeout_s
    while scheduler.has_finished_requests() or scheduler.finished_req_ids:
        if time.monotonic() > deadline:
            return False
        core.step()
        time.sleep(0.001)
    return True
