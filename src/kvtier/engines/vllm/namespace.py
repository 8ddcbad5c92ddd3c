"""The model part of a vLLM engine's namespace: everything in vLLM's config that changes the KV
computed for given token ids.

    engine_model_id(vllm_config)  # "SmolLM2-135M-Instruct@1f0c...+e3a94b2c01d7f655"

The weights' fingerprint (:func:`kvtier.model_id.model_fingerprint`: config files and every byte
of every weight file; a hub id at the ``revision`` vLLM serves) followed by a digest of what vLLM
itself decides on top of the files:

- ``hf_overrides`` as given (RoPE overrides are made through them; a callable is refused:
  name the namespace with ``model_id``), ``disable_sliding_window``, the config of
  ``hf_config_path`` when it is another one (at vLLM's revision), the ``quantization`` method,
  the model ``dtype``, the KV cache dtype, ``model_impl`` and ``code_revision`` (a
  ``trust_remote_code`` model's code) -- vLLM's inputs, not the config objects it derives
  (see :func:`engine_settings`);
- ``max_model_len`` when the config file or the overrides scale RoPE (a ``rope_type`` other
  than ``default``): some scalings (LongRoPE) pick their factors from it. Without RoPE scaling it is left out, so
  engines of one model with different context limits share chunks.

What is not in it, because it does not change KV for given ids: the tokenizer and its revision,
the generation config, sampling, the served name. How the KV is laid out in vLLM's pages --
vLLM's release, the attention backend, the ISA vLLM's CPU attention picks on the machine, the
KV dtype as stored, the block size, the shard -- is the namespace's other part, the page format
(:mod:`.pages`), which is added to this id even when ``model_id`` names it by hand.
"""

from __future__ import annotations

import json
import os

import xxhash

from kvtier.model_id import model_fingerprint, resolve_model_dir

_NOT_KV = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset")
"""Keys of a config that name where and by what it was written, not the model."""


def engine_model_id(vllm_config) -> str:  # type: ignore[no-untyped-def]
    """``<weights' fingerprint>+<16 hex>`` for the model ``vllm_config`` serves."""
    mc = vllm_config.model_config
    return f"{model_fingerprint(model_reference(mc))}+{engine_digest(vllm_config)}"


def model_reference(model_config) -> str:  # type: ignore[no-untyped-def]
    """What :func:`model_fingerprint` reads: the directory, or the hub id at vLLM's revision."""
    model = str(model_config.model)
    revision = getattr(model_config, "revision", None)
    if revision and not os.path.isdir(model) and "@" not in model:
        return f"{model}@{revision}"
    return model


def engine_settings(vllm_config) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """What vLLM decides on top of the model's files that changes its KV (see the module).
    Made of vLLM's *inputs* (the overrides as given), never of the config objects vLLM derives
    from them: a worker loads the model before it makes its connector, and some models' loading
    changes ``hf_config`` in place, in the worker's copy only (tensor parallelism pickles it),
    which would put the scheduler and its workers in different namespaces."""
    mc = vllm_config.model_config
    overrides = _overrides(getattr(mc, "hf_overrides", None))
    config_path = getattr(mc, "hf_config_path", None)
    revision = getattr(mc, "revision", None)
    other_config = bool(config_path) and config_path != mc.model
    settings: dict[str, object] = {
        "hf_overrides": overrides,
        "hf_config": _config_file(_at(config_path, revision), required=True) if other_config else None,
        "disable_sliding_window": bool(getattr(mc, "disable_sliding_window", False)),
        "quantization": _text(getattr(mc, "quantization", None)),
        "dtype": _text(getattr(mc, "dtype", None)),
        "kv_cache_dtype": _text(getattr(vllm_config.cache_config, "cache_dtype", None)),
        "code_revision": _text(getattr(mc, "code_revision", None)),
        "model_impl": _text(getattr(mc, "model_impl", None)),
    }
    base = _config_file(_at(config_path, revision) if other_config else model_reference(mc), required=True)
    if _scales_rope(base) or _scales_rope(overrides):
        settings["max_model_len"] = getattr(mc, "max_model_len", None)
    return settings


def _at(model: str, revision: str | None) -> str:
    """A hub id at ``revision`` (a directory as it is)."""
    return f"{model}@{revision}" if revision and not os.path.isdir(model) and "@" not in model else model


def _overrides(value: object) -> dict[str, object]:
    """``hf_overrides`` as given (a dict). A callable can change anything and says nothing of
    what: two of them of one name may set different values, so it is refused -- name the
    namespace yourself (``kv_connector_extra_config.model_id``)."""
    if not value:
        return {}
    if callable(value) or not isinstance(value, dict):
        raise ValueError(
            "kvtier cannot tell what a callable hf_overrides changes in the model's KV: set "
            "kv_connector_extra_config.model_id to a name that changes whenever the override does")
    return _clean(value)  # type: ignore[return-value]


def _config_file(model: str, required: bool = False) -> dict[str, object]:
    """The ``config.json`` of a model directory or a cached hub id (``required``: ValueError
    when it cannot be read -- what decides the namespace must not silently count as empty)."""
    try:
        root, _ = resolve_model_dir(model)
        raw = json.loads((root / "config.json").read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        if required:
            raise ValueError(f"kvtier: cannot read the config of {model!r} for the namespace ({exc}); "
                             "set kv_connector_extra_config.model_id") from None
        return {}
    return _clean(raw)  # type: ignore[return-value]


def engine_digest(vllm_config) -> str:  # type: ignore[no-untyped-def]
    raw = json.dumps(engine_settings(vllm_config), sort_keys=True, default=_text, separators=(",", ":"))
    return xxhash.xxh3_64_hexdigest(raw.encode())


def _clean(value: object) -> object:
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items() if k not in _NOT_KV}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _text(value)


def _scales_rope(hf: dict[str, object]) -> bool:
    """Whether the config scales RoPE (a ``rope_type`` other than the default), here or in a
    nested config (a VLM's ``text_config``)."""
    for name in ("rope_scaling", "rope_parameters"):
        rope = hf.get(name)
        if isinstance(rope, dict) and rope:
            kind = rope.get("rope_type", rope.get("type"))
            if kind not in (None, "default") or any(isinstance(v, dict) for v in rope.values()):
                return True  # a scaling, or one per attention type (each may scale)
    return any(_scales_rope(v) for v in hf.values() if isinstance(v, dict))


def _text(value: object) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


__all__ = ["engine_digest", "engine_model_id", "engine_settings", "model_reference"]
