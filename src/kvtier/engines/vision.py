"""A vision-language chat engine over the store: image-aware KV keys, cached encoder outputs.

    engine = VisionEngine(default_vlm_dir(), store)
    turn = engine.generate([{"role": "user", "content": "<image> What is this?"}], images=[png])

Each ``<image>`` in the text stands for the next image of ``images`` (image file bytes). In the
prompt it becomes one placeholder token per image patch, and the chunks those tokens fall in
carry the image's content hash in their keys (:func:`kvtier.core.keys.image_extras`): the same
text with another image never shares KV from there on, the same image in a later turn, or in
another user's identical prompt, does. When the cached prefix ends before an image, its
encoder output is needed: it comes from the store (a typed object keyed by the image's content
hash and the encoder's fingerprint, shared across turns and users) or is computed and stored,
with the encoder time as its recompute cost. Output equals a full recompute's.

Loading here is whole-prefix (not layer-wise) and saving synchronous: this engine shows the
keys and the encoder cache; :class:`kvtier.engines.hf.HFEngine` is the text engine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache, LlavaForConditionalGeneration

from kvtier.core.keys import image_extras
from kvtier.core.objects import ObjectKind, content_hash, object_key
from kvtier.engines.chat_render import chat_prompt_ids
from kvtier.engines.default_vlm import pixel_values
from kvtier.engines.hf import Message, model_fingerprint
from kvtier.store import KVStore
from kvtier.typed import TypedObjects


@dataclass(frozen=True, slots=True)
class VisionTurn:
    prompt_tokens: int
    hit_tokens: int
    token_ids: list[int]
    text: str
    first_logits: torch.Tensor
    encoder_runs: int
    """Images whose encoder ran in this turn (not cached, and needed)."""
    encoder_hits: int
    """Images whose encoder output came from the store."""
    image_spans: list[tuple[int, int, str]] = field(default_factory=list)


class VisionEngine:
    def __init__(self, model_dir: str | Path, store: KVStore | None, max_new_tokens: int = 8) -> None:
        self._requests = itertools.count()
        self.model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.store = store
        self.objects = TypedObjects(store) if store is not None else None
        self.max_new_tokens = max_new_tokens
        self.image_token = int(self.model.config.image_token_index)
        self.encoder_id = f"{model_fingerprint(model_dir)}:vision"
        self.hidden = int(self.model.config.text_config.hidden_size)

    # -- prompt -------------------------------------------------------------------------------
    def prompt(self, messages: Sequence[Message], images: Sequence[bytes]) -> tuple[list[int], list[tuple[int, int, str]]]:
        """Token ids with each image expanded to its placeholders, and the images' spans."""
        from kvtier.engines.default_vlm import IMAGE_TOKENS

        ids = chat_prompt_ids(self.tokenizer, messages)
        marks = [i for i, t in enumerate(ids) if t == self.image_token]
        if len(marks) != len(images):
            raise ValueError(f"the messages hold {len(marks)} <image> markers but {len(images)} images were given")
        out: list[int] = []
        spans: list[tuple[int, int, str]] = []
        prev = 0
        for mark, image in zip(marks, images):
            out += ids[prev:mark]
            spans.append((len(out), len(out) + IMAGE_TOKENS, content_hash(image)))
            out += [self.image_token] * IMAGE_TOKENS
            prev = mark + 1
        return out + ids[prev:], spans

    # -- encoder ------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, image: bytes, use_store: bool = True) -> tuple[torch.Tensor, bool]:
        """The projected encoder output of an image ``[tokens, hidden]``, and whether it came
        from the store (a computed one is stored, with the encoder time as its cost)."""
        objects = self.objects if use_store else None
        key = object_key(ObjectKind.ENCODER_OUTPUT, content_hash(image), self.encoder_id)
        if objects is not None:
            hit = objects.get(key)
            if hit is not None:
                return hit.data.view(torch.float32).view(-1, self.hidden), True
        t0 = time.perf_counter()
        feats = self.model.get_image_features(pixel_values=pixel_values(image)[None]).pooler_output[0]
        if objects is not None:
            objects.put(key, feats.contiguous(), ObjectKind.ENCODER_OUTPUT,
                        recompute_s=time.perf_counter() - t0)
        return feats, False

    # -- a turn -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, messages: Sequence[Message], images: Sequence[bytes] = (),
                 use_store: bool = True) -> VisionTurn:
        ids, spans = self.prompt(messages, images)
        store = self.store if use_store else None
        extras = image_extras(spans, store.layout.chunk_tokens) if store is not None else {}
        cache = DynamicCache()
        hit_tokens = 0
        request = f"vision-{id(self):x}-{next(self._requests)}"
        if store is not None:  # the policies count this turn's lookup and save as one use
            store.started(request)
        if store is not None and len(ids) > 1:
            loaded = store.load(store.lookup(ids[:-1], extras=extras, request=request), request=request)
            hit_tokens = loaded.tokens
            for layer, (k, v) in enumerate(loaded.kv):
                if hit_tokens:
                    cache.update(k[None].contiguous(), v[None].contiguous(), layer)
        tensor = torch.tensor([ids])
        embeds = self.model.get_input_embeddings()(tensor[:, hit_tokens:])
        runs = hits = 0
        for (start, end, _), image in zip(spans, images):
            if end <= hit_tokens:
                continue  # inside the cached prefix: its KV is there, the encoder is not needed
            feats, cached = self.encode(image, use_store)
            hits += cached
            runs += not cached
            lo = max(start, hit_tokens)
            embeds[0, lo - hit_tokens : end - hit_tokens] = feats[lo - start :].to(embeds.dtype)
        out = self.model(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1]
        first_logits = logits.clone()
        generated: list[int] = []
        eos = self.tokenizer.eos_token_id
        for _ in range(self.max_new_tokens):
            token = int(logits.argmax())
            generated.append(token)
            if token == eos or len(generated) == self.max_new_tokens:
                break
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            logits = out.logits[0, -1]
        if store is not None:
            tokens = ids + generated[:-1]
            kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
            store.save(tokens, kv, extras=extras, request=request)
            store.finished(request)
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        return VisionTurn(len(ids), hit_tokens, generated, text, first_logits, runs, hits, spans)
