"""Two machines, one conversation: turn 1 is served by a process with its own store, turn 2 by
this process with another store (its own DRAM, nothing in common but the remote tier), and turn
2 hits what turn 1 left in the remote tier, with the same output as a full recompute."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from kvtier import HostTierConfig, KVStore, StoreConfig
from kvtier.engines.hf import EngineConfig, HFEngine, model_fingerprint
from kvtier.store import RemoteConfig
from kvtier.tiers.valkey import ValkeyTierConfig
from tests.remote_servers import unique_prefix

from .conftest import QUESTIONS, SYSTEM, C, assert_same_as_recompute

MACHINE_A = textwrap.dedent("""
    import json, sys
    from kvtier import HostTierConfig, KVStore, StoreConfig
    from kvtier.engines.hf import EngineConfig, HFEngine, kv_layout_for, model_fingerprint
    from kvtier.store import RemoteConfig
    from kvtier.tiers.valkey import ValkeyTierConfig
    from transformers import AutoConfig
    model_dir, address, prefix, system, question = sys.argv[1:6]
    layout = kv_layout_for(AutoConfig.from_pretrained(model_dir), int(sys.argv[6]))
    remote = RemoteConfig(ValkeyTierConfig((address,), 256 << 20, prefix=prefix))
    store = KVStore(StoreConfig(model=model_fingerprint(model_dir), layout=layout, remote=remote,
                                host=HostTierConfig(256 * layout.chunk_bytes)))
    engine = HFEngine(model_dir, store, EngineConfig(max_new_tokens=8))
    got = engine.generate([{"role": "system", "content": system}, {"role": "user", "content": question}])
    engine.wait_for_saves()
    assert store.flush(timeout=30)
    print(json.dumps({"text": got.text, "uploaded": store.snapshot()["uploads"]["uploaded"]}))
    engine.close()
""")


def test_turn_two_on_another_machine_hits_the_remote_tier_with_the_same_output(
        tiny, valkey_standalone):
    prefix = unique_prefix()
    child = subprocess.run(
        [sys.executable, "-c", MACHINE_A, str(tiny.path), valkey_standalone.address, prefix,
         SYSTEM, QUESTIONS[0], str(C)],
        capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=300, check=True)
    turn1 = json.loads(child.stdout.strip().splitlines()[-1])
    assert turn1["uploaded"] > 0

    layout = tiny.layout()
    remote = RemoteConfig(ValkeyTierConfig((valkey_standalone.address,), 256 << 20, prefix=prefix))
    store = KVStore(StoreConfig(model=model_fingerprint(tiny.path), layout=layout, remote=remote,
                                host=HostTierConfig(256 * layout.chunk_bytes)))
    engine = HFEngine(tiny.path, store, EngineConfig(max_new_tokens=8),
                      model=tiny.model, tokenizer=tiny.tokenizer)
    try:
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]},
                   {"role": "assistant", "content": turn1["text"]},
                   {"role": "user", "content": QUESTIONS[1]}]
        baseline = engine.generate(history, use_store=False)
        got = engine.generate(history)
        assert got.hit_tokens >= turn1["uploaded"] * C > 0
        assert got.tier == store.remote.name and got.tier_tokens == {store.remote.name: got.hit_tokens}
        assert_same_as_recompute(got, baseline)
    finally:
        engine.close()
