"""The split prefix attention: attending to a cached prefix without a mask and to the new tokens
causally, merged by log-sum-exp, equals attention with the bottom-right causal mask."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvtier.engines import attention
from kvtier.engines.attention import prefix_sdpa_forward

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


class Layer(torch.nn.Module):
    """What the attention function reads from a decoder layer."""

    def __init__(self) -> None:
        super().__init__()
        self.num_key_value_groups = HEADS // KV_HEADS
        self.is_causal = True


def qkv(prefix: int, q_len: int, seed: int):
    """Query ``[1, HEADS, q_len, D]`` and key/value ``[1, KV_HEADS, prefix + q_len, D]``, laid out
    as a Llama attention hands them over (transposed views, not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    kv_len = prefix + q_len
    q = torch.randn(1, q_len, HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    k = torch.randn(1, kv_len, KV_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    v = torch.randn(1, kv_len, KV_HEADS, HEAD_DIM, generator=g).transpose(1, 2)
    return q, k, v


def bottom_right_causal(q_len: int, kv_len: int) -> torch.Tensor:
    """Query ``i`` (the ``prefix + i``-th token) may see keys ``0 .. prefix + i``."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)


def reference(q, k, v, scale: float) -> torch.Tensor:
    """Softmax of the masked scores, in float64; ``[1, q_len, HEADS, D]`` like the function."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)  # query head h reads kv head h // groups
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~bottom_right_causal(q.shape[2], k.shape[2]), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).float()


@pytest.mark.parametrize("scaling", [None, 0.3])
@pytest.mark.parametrize(
    ("prefix", "q_len"),
    [
        (16, 9),  # a follow-up prefilled after a cached chunk
        (37, 64),  # more new tokens than cached ones, prefix not chunk aligned
        (256, 5),
        (1, 2),
        (0, 7),  # nothing cached: falls back to plain causal SDPA
        (12, 1),  # one token to compute: falls back
        (0, 1),
    ],
)
def test_prefix_attention_equals_masked_softmax(prefix, q_len, scaling):
    q, k, v = qkv(prefix, q_len, seed=prefix * 1000 + q_len)
    scale = scaling if scaling is not None else HEAD_DIM**-0.5

    out, weights = prefix_sdpa_forward(Layer(), q, k, v, None, scaling=scaling)

    assert weights is None
    assert out.shape == (1, q_len, HEADS, HEAD_DIM)
    want = reference(q, k, v, scale)
    assert torch.allclose(out, want, rtol=0, atol=1e-5), float((out - want).abs().max())
    # and stock SDPA given the explicit mask agrees too
    groups = HEADS // KV_HEADS
    sdpa = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
        attn_mask=bottom_right_causal(q_len, prefix + q_len), scale=scale,
    ).transpose(1, 2)
    assert torch.allclose(out, sdpa, rtol=0, atol=1e-5)


def test_without_grouped_heads_the_result_is_the_same():
    class Plain(torch.nn.Module):  # an older module without num_key_value_groups: MHA
        is_causal = True

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g) for n in (6, 20, 20))
    out, _ = prefix_sdpa_forward(Plain(), q, k, v, None)
    scores = (q @ k.transpose(-1, -2)) * HEAD_DIM**-0.5
    want = scores.masked_fill(~bottom_right_causal(6, 20), float("-inf")).softmax(-1) @ v
    assert torch.allclose(out, want.transpose(1, 2), rtol=0, atol=1e-5)


def test_it_is_registered_and_the_default_model_loads_with_it(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    assert AttentionInterface()[attention.NAME] is prefix_sdpa_forward
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention.NAME)
    assert model.config._attn_implementation == attention.NAME
