"""Chapter 03 — rotary position embeddings.

Your ``rope_inv_freq`` (exercises/minivllm/layers/rotary.py) and ``apply_rotary``
(exercises/minivllm/ops/rotary.py) are
compared with transformers' Qwen3 RoPE (``compute_default_rope_parameters``,
``Qwen3RotaryEmbedding``, ``apply_rotary_pos_emb``) and with float64 math, for many head
sizes, bases, positions and dtypes; then a Qwen3 model built on them must give
transformers' logits over a long sequence, where every position's rotation matters.

Tolerances: the frequencies are float32 against a float64 reference, and ``base ** e``
in float32 amplifies the rounding of e by ln(base) (~14 for base 1e6), so 1e-5 relative.
Rotations in float32 agree to a few ulps, 1e-5 relative; in bfloat16 and float16 an
answer may round once more than transformers, so two units in the last place (1.6e-2 and
2e-3 relative).
"""
import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from minivllm.context import reset_context
from minivllm.layers.rotary import RotaryEmbedding, rope_inv_freq
from minivllm.loader import load_model
from minivllm.ops.rotary import apply_rotary
from minivllm.testing import make_tiny_checkpoint

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-5)}
BASES = [10_000.0, 500_000.0, 1_000_000.0, 2.0]


def hf_config(head_dim, base):
    return Qwen3Config(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": base})


def assert_close(actual, expected):
    assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual).__name__}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype}, expected {expected.dtype}"
    rtol, atol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# --- rope_inv_freq --------------------------------------------------------------------


@settings(max_examples=25)
@given(half=st.integers(1, 128), base=st.sampled_from(BASES))
def test_ch03_inv_freq_matches_reference(half, base):
    rotary_dim = 2 * half
    out = rope_inv_freq(rotary_dim, base)
    expected = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    assert isinstance(out, torch.Tensor), f"expected a tensor, got {type(out).__name__}"
    assert out.shape == (half,), f"shape {tuple(out.shape)}, expected ({half},): one frequency per channel pair"
    assert out.dtype == torch.float32, f"dtype {out.dtype}, expected torch.float32"
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("head_dim, base", [(128, 1_000_000.0), (64, 10_000.0), (16, 500_000.0)])
def test_ch03_inv_freq_matches_transformers(head_dim, base):
    expected, _ = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf_config(head_dim, base))
    torch.testing.assert_close(rope_inv_freq(head_dim, base), expected.float(), rtol=1e-5, atol=0)


# --- apply_rotary ---------------------------------------------------------------------


def angles(tokens, rotary_dim, base, seed):
    """cos and sin ([tokens, rotary_dim / 2]) at random positions, computed here."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (tokens,), generator=g).double()
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    theta = positions[:, None] * inv_freq[None, :]
    return theta.cos().float(), theta.sin().float()


def hf_rotate(x, cos, sin):
    """transformers' rotation of x [tokens, heads, dim], cos/sin of shape [tokens, dim / 2]."""
    full_cos, full_sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    xh = x.transpose(0, 1)[None]  # [1, heads, tokens, dim]
    out, _ = apply_rotary_pos_emb(xh, xh, full_cos, full_sin, unsqueeze_dim=1)
    return out[0].transpose(0, 1)


@settings(max_examples=30)
@given(
    tokens=st.integers(1, 6),
    heads=st.integers(1, 3),
    rotary_dim=st.sampled_from([2, 4, 8, 32, 128]),
    base=st.sampled_from(BASES),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
)
def test_ch03_apply_rotary_matches_transformers(tokens, heads, rotary_dim, base, dtype, seed):
    cos, sin = angles(tokens, rotary_dim, base, seed)
    cos, sin = cos.to(dtype), sin.to(dtype)
    x = torch.randn(tokens, heads, rotary_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    before = x.clone()
    out = apply_rotary(x, cos, sin)
    assert torch.equal(x, before), "apply_rotary must not change its input"
    assert_close(out, hf_rotate(x, cos, sin))


def test_ch03_channels_pair_with_the_other_half():
    # One token rotated by 90 degrees in every pair: channel i goes to i + d/2 (halves),
    # not to i + 1 (interleaved pairs); x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
    x = torch.arange(1.0, 9.0).reshape(1, 1, 8)  # x1 = [1, 2, 3, 4], x2 = [5, 6, 7, 8]
    cos, sin = torch.zeros(1, 4), torch.ones(1, 4)
    expected = torch.tensor([[[-5.0, -6.0, -7.0, -8.0, 1.0, 2.0, 3.0, 4.0]]])
    assert_close(apply_rotary(x, cos, sin), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ch03_rotary_embedding_matches_transformers(dtype):
    # Queries and keys of different head counts at scattered, unsorted positions.
    head_dim, base = 32, 1_000_000.0
    positions = torch.tensor([0, 7, 3, 511, 100])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, 4, head_dim, generator=g).to(dtype)
    k = torch.randn(5, 2, head_dim, generator=g).to(dtype)
    ours_q, ours_k = RotaryEmbedding(head_dim, 512, base)(positions, q, k)
    hf = Qwen3RotaryEmbedding(hf_config(head_dim, base))
    cos, sin = hf(q, positions[None])  # [1, tokens, head_dim], in q's dtype
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert_close(ours_q, hf_q[0].transpose(0, 1))
    assert_close(ours_k, hf_k[0].transpose(0, 1))


@settings(max_examples=15)
@given(m=st.integers(0, 4000), n=st.integers(0, 4000), shift=st.integers(1, 4000), seed=st.integers(0, 2**31))
def test_ch03_scores_depend_only_on_distance(m, n, shift, seed):
    # The property RoPE is built for: q at m and k at n score the same as at m + s and n + s.
    # In float64 with exact angles, so the two scores agree to ~1e-12; 1e-8 is generous.
    inv_freq = rope_inv_freq(64, 10_000.0).double()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 64, generator=g, dtype=torch.float64)

    def rotate(x, position):
        theta = position * inv_freq[None, :]
        return apply_rotary(x, theta.cos(), theta.sin())

    def score(i, j):
        return (rotate(q, i) * rotate(k, j)).sum()

    torch.testing.assert_close(score(m, n), score(m + shift, n + shift), rtol=1e-8, atol=1e-8)
    if m != n:
        assert not torch.allclose(score(m, n), (q * k).sum(), rtol=0, atol=1e-6), "positions had no effect"


# --- the whole model ------------------------------------------------------------------


@pytest.mark.parametrize("base", [1_000_000.0, 10_000.0])
def test_ch03_qwen3_logits_match_transformers(tmp_path, base):
    # Float32 on both sides: ~1e-6 apart on logits of order 1; 1e-4 leaves room for that
    # and none for a wrong rotation, which moves logits by ~1e-1. A long sequence (200
    # tokens) makes the slow, low-frequency channels turn by a visible angle too.
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path, rope_theta=base)
    model = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    reset_context()
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(200)), all_tokens=True)
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
