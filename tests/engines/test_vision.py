"""A vision-language chat on the embedded LLaVA-architecture model: KV keys that depend on the
image, and encoder outputs reused across turns and users, every turn equal to a recompute."""

import pytest
import torch

from kvtier import HostTierConfig, KVStore, StoreConfig
from kvtier.engines.default_vlm import IMAGE_TOKENS, default_vlm_dir, png
from kvtier.engines.hf import kv_layout_for, model_fingerprint
from kvtier.engines.vision import VisionEngine

C = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = default_vlm_dir(tmp_path_factory.mktemp("vlm-home"))
    from transformers import AutoConfig

    layout = kv_layout_for(AutoConfig.from_pretrained(path), C)
    store = KVStore(StoreConfig(model=model_fingerprint(path), layout=layout,
                                host=HostTierConfig(512 * layout.chunk_bytes)))
    yield VisionEngine(path, store)
    store.close()


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": f"Look: <image> {question}"}]


def same_as_recompute(engine, messages, images):
    got = engine.generate(messages, images)
    want = engine.generate(messages, images, use_store=False)
    assert got.token_ids == want.token_ids
    assert torch.allclose(got.first_logits, want.first_logits, rtol=0, atol=1e-5)
    return got


def test_same_text_with_another_image_never_hits_past_the_image(engine):
    cat, dog = png(1), png(2)
    first = same_as_recompute(engine, chat("What is it?"), [cat])
    assert first.encoder_runs == 1
    (start, end, _), = first.image_spans
    assert end - start == IMAGE_TOKENS
    other = same_as_recompute(engine, chat("What is it?"), [dog])
    assert other.hit_tokens == start // C * C  # the text before the image only
    again = same_as_recompute(engine, chat("What is it?"), [cat])
    assert again.hit_tokens >= end // C * C and again.hit_tokens > other.hit_tokens


def test_an_encoder_output_is_reused_by_a_later_turn_and_by_another_user(engine):
    photo = png(7)
    turn1 = same_as_recompute(engine, chat("Describe it."), [photo])
    runs_before = engine.objects.stats.puts["ENCODER_OUTPUT"]
    assert turn1.encoder_runs == 1
    # another user, another system prompt: no KV in common, but the image's encoder output
    other = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "<image> and what colour?"}]
    turn = same_as_recompute(engine, other, [photo])
    assert turn.hit_tokens == 0 and turn.encoder_hits == 1 and turn.encoder_runs == 0
    assert engine.objects.stats.puts["ENCODER_OUTPUT"] == runs_before
    # the first user's next turn: the image's KV is in the cached prefix, no encoder needed
    history = chat("Describe it.") + [{"role": "assistant", "content": turn1.text},
                                      {"role": "user", "content": "More detail."}]
    turn2 = same_as_recompute(engine, history, [photo])
    assert turn2.hit_tokens >= turn1.image_spans[0][1] and turn2.encoder_runs == turn2.encoder_hits == 0


def test_markers_and_images_must_match(engine):
    with pytest.raises(ValueError, match="1 <image> markers but 2 images"):
        engine.generate(chat("x"), [png(1), png(2)])
    with pytest.raises(ValueError, match="not an image file"):
        engine.generate(chat("x"), [b"not a png"], use_store=False)
