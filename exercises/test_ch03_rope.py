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

Also graded: Llama 3's frequency scaling, frequency by frequency against the rule in
float64; the cos/sin cache of ``RotaryEmbedding`` for every scaling type; partial rotary.
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


# --- Llama 3 scaling and the cos/sin cache --------------------------------------------

import math  # noqa: E402

from minivllm.layers.rotary import llama3_scale_inv_freq  # noqa: E402
from minivllm.ops.rotary import rotate  # noqa: E402

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
OTHER = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
         "original_max_position_embeddings": 1024}


def llama3_rule(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Llama 3's rule, one frequency at a time, in float64 (Meta's reference implementation)."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for freq in inv_freq.double().tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


def parameters(scaling):
    return {k: v for k, v in scaling.items() if k != "rope_type"}


@pytest.mark.parametrize("head_dim, base, scaling", [(128, 500_000.0, LLAMA31), (64, 10_000.0, OTHER),
                                                     (32, 10_000.0, LLAMA31)])
def test_ch03_llama3_scaling_follows_the_rule(head_dim, base, scaling):
    inv_freq = rope_inv_freq(head_dim, base)
    ours = llama3_scale_inv_freq(inv_freq, **parameters(scaling))
    expected = llama3_rule(inv_freq, **parameters(scaling))
    kinds = {"kept": 0, "slowed": 0, "blended": 0}
    for ours_f, freq, exp_f in zip(ours.tolist(), inv_freq.tolist(), expected.tolist()):
        kinds["kept" if exp_f == freq else "slowed" if math.isclose(exp_f, freq / scaling["factor"]) else "blended"] += 1
    assert ours.shape == inv_freq.shape, f"one frequency per pair: shape {tuple(ours.shape)}"
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=0, msg=lambda m: (
        f"short wavelengths keep their frequency, long ones are slowed by factor, those in between blend "
        f"({kinds}): {m}"))


def expected_cache(head_dim, max_position, base, rotary_dim=None, scaling=None):
    inv_freq = rope_inv_freq(rotary_dim or head_dim, base).double()
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        inv_freq = llama3_rule(inv_freq, **parameters(scaling))
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, LLAMA31, OTHER,
                                     {"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 2.0}],
                         ids=["none", "default", "llama31", "llama3-other", "linear", "linear-old-key"])
def test_ch03_the_cos_sin_cache(scaling):
    head_dim, max_position, base = 32, 300, 10_000.0
    rope = RotaryEmbedding(head_dim, max_position, base, scaling=scaling)
    cos, sin = expected_cache(head_dim, max_position, base, scaling=scaling)
    for name, ours, exp in (("cos_cache", rope.cos_cache, cos), ("sin_cache", rope.sin_cache, sin)):
        assert ours.shape == (max_position, head_dim // 2), (
            f"{name}: one row per position up to max_position, one column per rotated pair: {tuple(ours.shape)}")
        assert ours.dtype == torch.float32, f"{name} is float32, got {ours.dtype}"
        torch.testing.assert_close(ours.double(), exp, rtol=0, atol=2e-4, msg=lambda m: (
            f"{name}[t, i] is the {name[:3]} of position t times pair i's (scaled) inverse frequency: {m}"))
    assert "cos_cache" not in rope.state_dict() and "sin_cache" not in rope.state_dict(), \
        "the caches come from the config: buffers that are not saved in the state dict"


def test_ch03_an_unknown_scaling_is_an_error():
    with pytest.raises(ValueError, match="yarn"):
        RotaryEmbedding(32, 64, 10_000.0, scaling={"rope_type": "yarn", "factor": 4.0})


def test_ch03_partial_rotary_cache_and_rotation():
    # rotary_dim 8 of head_dim 16: the first 8 channels turn, pairs (i, i + 4); the rest pass through.
    head_dim, rotary_dim, base = 16, 8, 10_000.0
    rope = RotaryEmbedding(head_dim, 64, base, rotary_dim=rotary_dim)
    cos, sin = expected_cache(head_dim, 64, base, rotary_dim=rotary_dim)
    torch.testing.assert_close(rope.cos_cache.double(), cos, rtol=0, atol=2e-4,
                               msg=lambda m: f"the cache covers the rotary_dim / 2 rotated pairs only: {m}")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, head_dim, generator=g)
    positions = torch.tensor([0, 1, 9, 33, 63])
    c, s = rope.cos_cache[positions], rope.sin_cache[positions]
    out = rotate(x, c, s)
    x1, x2, rest = x[..., :4], x[..., 4:8], x[..., 8:]
    c, s = c[:, None, :], s[:, None, :]
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=lambda m: (
        f"the first rotary_dim channels rotate (i with i + rotary_dim / 2), the others pass through after them: {m}"))
    full = torch.randn(2, 1, rotary_dim, generator=g)
    torch.testing.assert_close(rotate(full, rope.cos_cache[:2], rope.sin_cache[:2]),
                               apply_rotary(full, rope.cos_cache[:2], rope.sin_cache[:2]),
                               msg=lambda m: f"when every channel turns, rotate is apply_rotary: {m}")
