"""The embedded vision-language model: LLaVA's architecture with deterministic random weights.

A CLIP vision tower and a projector in front of the tiny Llama text model, from transformers'
own ``LlavaForConditionalGeneration``; the character tokenizer of
:mod:`kvtier.engines.default_model` plus one ``<image>`` token, which a prompt repeats once per
image patch (16 per 32x32 image). Built once and cached beside the default text models. Images
are ordinary image files (PNG, JPEG: anything Pillow opens); :func:`pixel_values` turns their
bytes into the tower's input.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import torch

from kvtier.engines.default_model import SIZES, build_once, build_tokenizer, models_home

BUILD_VERSION = 1
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
"""Placeholder tokens one image takes in a prompt."""
_MEAN = torch.tensor([0.481, 0.458, 0.408]).view(3, 1, 1)
_STD = torch.tensor([0.269, 0.261, 0.276]).view(3, 1, 1)


def build_vlm_tokenizer():  # type: ignore[no-untyped-def]
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer


def default_vlm_dir(home: str | os.PathLike[str] | None = None) -> Path:
    """Path of the embedded VLM, building it on first use (atomically)."""
    root = Path(home) / "models" if home is not None else models_home()
    return build_once(root / f"kvtier-llava-tiny-v{BUILD_VERSION}", "config.json", _build)


def _build(path: Path) -> None:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tokenizer = build_vlm_tokenizer()
    text = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=16384, rope_theta=10000.0,
        rms_norm_eps=1e-5, initializer_range=0.05, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **SIZES["tiny"],
    )
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(4321 + BUILD_VERSION)
        model = LlavaForConditionalGeneration(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "kvtier.json").write_text(json.dumps({"size": "tiny-vlm", "build_version": BUILD_VERSION}))


def pixel_values(image: bytes) -> torch.Tensor:
    """``[3, 32, 32]`` normalized input of the vision tower for an image file's bytes."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(image)).convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE))
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds
        raise ValueError(f"not an image file Pillow can read: {exc}") from None
    raw = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    pixels = raw.view(IMAGE_SIZE, IMAGE_SIZE, 3).permute(2, 0, 1).float() / 255.0
    return (pixels - _MEAN) / _STD


def png(seed: int, size: int = 48) -> bytes:
    """A deterministic test image (PNG bytes) -- stands in for a photo a user sends."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8, generator=g)
    out = io.BytesIO()
    Image.fromarray(data.numpy()).save(out, format="PNG")
    return out.getvalue()
