"""Moving cached keys by rotation: a key computed at position p and rotated by d is the key the
model computes at p + d, for every RoPE variant kvtier shifts; the others are refused with a
reason. Keys come from the models' own k_proj, rotary embedding and apply_rotary_pos_emb."""

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3

from kvtier.engines.rope import RotaryShift, rope_type_of, shift_refusal

SHAPE = {
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
               "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
             "rope_theta": 10000.0},
}


def llama(rope: dict[str, object]) -> LlamaForCausalLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**SHAPE, head_dim=16, rope_parameters=rope)).eval()


def phi3_partial() -> Phi3ForCausalLM:
    """Phi-3 rotating only half of each 16-dim head."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Phi3ForCausalLM(Phi3Config(**SHAPE, partial_rotary_factor=0.5)).eval()


def keys_at(model, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Layer 0's keys for ``hidden`` placed at ``positions``, as its attention computes them."""
    attn = model.model.layers[0].self_attn
    head_dim = attn.head_dim
    if hasattr(attn, "k_proj"):
        k = attn.k_proj(hidden)
        apply = modeling_llama.apply_rotary_pos_emb
    else:  # Phi-3 projects q, k, v together
        q_size = model.config.num_attention_heads * head_dim
        k = attn.qkv_proj(hidden)[..., q_size : q_size + model.config.num_key_value_heads * head_dim]
        apply = modeling_phi3.apply_rotary_pos_emb
    k = k.view(1, hidden.shape[1], -1, head_dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(hidden, positions[None])
    return apply(k, k, cos, sin)[1]


MODELS = {name: (lambda rope=rope: llama(rope)) for name, rope in VARIANTS.items()}
MODELS["phi3-partial"] = phi3_partial


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("delta", [300, -200])
def test_a_rotated_key_is_the_key_at_the_shifted_position(name, delta):
    model = MODELS[name]()
    assert shift_refusal(model.config) is None
    shift = RotaryShift.of_model(model)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 64, model.config.hidden_size, generator=g)
    positions = torch.arange(200, 264) * 3  # spread out: 600 .. 789
    with torch.no_grad():
        before = keys_at(model, positions, hidden)
        after = keys_at(model, positions + delta, hidden)
    moved = shift.shift_keys(before, delta)
    scale = float(after.abs().max())
    assert float((moved - after).abs().max()) <= 2e-5 * scale  # float32 rounding of p * inv_freq
    assert float((before - after).abs().max()) > 0.1 * scale  # and the shift did matter


def test_partial_rotary_leaves_the_unrotated_dimensions_alone():
    model = phi3_partial()
    shift = RotaryShift.of_model(model)
    assert (shift.rotary_dim, shift.head_dim) == (8, 16)
    keys = torch.randn(2, 5, 16)
    assert torch.equal(shift.shift_keys(keys, 77)[..., 8:], keys[..., 8:])


@pytest.mark.parametrize("name", ["default", "yarn"])
def test_a_whole_forward_pass_moved_by_d_has_the_rotated_cache(name):
    """RoPE attention depends on relative positions only: the same tokens run at positions
    p + d leave in every layer the keys of positions p rotated by d, and the same values."""
    model = MODELS[name]()
    shift = RotaryShift.of_model(model)
    ids = torch.randint(3, 64, (1, 48), generator=torch.Generator().manual_seed(2))
    d = 500
    with torch.no_grad():
        at_0 = model(ids, position_ids=torch.arange(48)[None], use_cache=True).past_key_values
        at_d = model(ids, position_ids=torch.arange(d, d + 48)[None], use_cache=True).past_key_values
    for a, b in zip(at_0.layers, at_d.layers, strict=True):
        assert torch.allclose(shift.shift_keys(a.keys, d), b.keys, rtol=0, atol=1e-4)
        assert torch.allclose(a.values, b.values, rtol=0, atol=1e-4)


def test_shifting_preserves_dtype_and_device_and_does_not_touch_its_input():
    shift = RotaryShift.of_model(llama(VARIANTS["default"]))
    keys = torch.randn(2, 7, 16).to(torch.bfloat16)
    copy = keys.clone()
    out = shift.shift_keys(keys, -13)
    assert (out.dtype, out.device, out.shape) == (keys.dtype, keys.device, keys.shape)
    assert torch.equal(keys, copy)
    back = shift.shift_keys(shift.shift_keys(keys.float(), -13), 13)
    assert torch.allclose(back, keys.float(), atol=1e-5)
    assert torch.equal(shift.shift_keys(keys, 0), keys)
    with pytest.raises(ValueError, match="head dim"):
        shift.shift_keys(torch.randn(2, 7, 8), 1)


def test_rope_that_is_not_a_rotation_under_a_shift_is_refused_with_the_reason():
    dynamic = llama({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert rope_type_of(dynamic.config) == "dynamic"
    reason = shift_refusal(dynamic.config)
    assert reason is not None and "dynamic" in reason and "sequence length" in reason
    with pytest.raises(ValueError, match="dynamic"):
        RotaryShift.of_model(dynamic)

    longrope = LlamaConfig(**SHAPE, head_dim=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8, "original_max_position_embeddings": 1024,
    })
    assert "longrope" in shift_refusal(longrope)

    assert "gpt2" in shift_refusal(GPT2Config(n_layer=1, n_embd=32, n_head=2))  # no RoPE at all
    interleaved = LlamaConfig(**SHAPE)
    interleaved.model_type = "glm"  # GLM pairs dimensions (2i, 2i+1): a different rotation
    assert "glm" in shift_refusal(interleaved)
