"""Chapter 11 — more model families: Gemma's RMSNorm and the sliding-window mask.

Your ``gemma_rms_norm`` (exercises/minivllm/ops/norm.py) is checked against
transformers' own ``Gemma3RMSNorm`` on random inputs and weights (weights near zero, as
Gemma stores them, and far from it), in float32 and bfloat16 (Gemma rounds only once, at
the very end: a norm that rounds earlier is off by a bf16 ulp somewhere). Your
``sliding_window_attention`` (exercises/minivllm/ops/attention.py) is checked against an
explicitly masked softmax in float64 for random windows and lengths, as the tail of a
longer sequence (a decode step or a chunk) and from its start. Finally a tiny Gemma 3
(local layers with a window of 16 among global ones) must give transformers' logits on a
prompt much longer than the window.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from minivllm.context import reset_context
from minivllm.ops.attention import sliding_window_attention
from minivllm.ops.norm import gemma_rms_norm
from minivllm.testing import make_tiny_checkpoint, torch_threads

# --- Gemma's RMSNorm ----------------------------------------------------------------------


@given(rows=st.integers(1, 9), hidden=st.integers(1, 80), weight_scale=st.sampled_from([0.05, 1.0, 3.0]),
       eps=st.sampled_from([1e-6, 1e-2]), seed=st.integers(0, 2**31 - 1))
def test_gemma_rms_norm_matches_transformers_float32(rows, hidden, weight_scale, eps, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * 3
    norm = Gemma3RMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g) * weight_scale)
        expected = norm(x)
    out = gemma_rms_norm(x, norm.weight.detach(), eps)
    assert out.shape == x.shape and out.dtype == x.dtype, "gemma_rms_norm must keep x's shape and dtype"
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_gemma_rms_norm_scales_by_one_plus_weight():
    """A zero weight is the identity scaling: the plain normalised x, not zeros."""
    x = torch.randn(4, 16)
    out = gemma_rms_norm(x, torch.zeros(16), 1e-6)
    torch.testing.assert_close(out, x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())
    assert out.abs().min() > 0


def test_gemma_rms_norm_bfloat16_rounds_once():
    torch.manual_seed(0)
    hidden = 256
    x = (torch.randn(64, hidden) * 4).bfloat16()
    norm = Gemma3RMSNorm(hidden, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.5)
        expected = norm(x)
    out = gemma_rms_norm(x, norm.weight.detach(), 1e-6)
    assert out.dtype == torch.bfloat16, "the result comes back in x's dtype"
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


# --- the sliding-window mask --------------------------------------------------------------


def masked_reference(q, k, v, scale, window):
    """Softmax over keys j with p - window < j <= p, for queries at the last positions."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    p = torch.arange(kv_len - q_len, kv_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    scores = scores.masked_fill(~((j <= p) & (j > p - window)), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@given(kv_len=st.integers(1, 40), q_frac=st.floats(0, 1), window=st.integers(1, 45),
       heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]), seed=st.integers(0, 2**31 - 1))
def test_sliding_window_attention_matches_the_mask(kv_len, q_frac, window, heads, seed):
    q_len = max(1, round(kv_len * q_frac))
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    q = torch.randn(q_len, num_heads, 8, generator=g)
    k = torch.randn(kv_len, num_kv_heads, 8, generator=g)
    v = torch.randn(kv_len, num_kv_heads, 8, generator=g)
    out = sliding_window_attention(q, k, v, 0.4, window)
    assert out.shape == q.shape, f"expected shape {tuple(q.shape)}, got {tuple(out.shape)}"
    torch.testing.assert_close(out, masked_reference(q, k, v, 0.4, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5])
def test_a_decode_step_sees_only_its_window(window):
    """One query at the end of 30 keys: changing keys outside its window changes nothing."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 8), torch.randn(30, 1, 8), torch.randn(30, 1, 8)
    out = sliding_window_attention(q, k, v, 0.5, window)
    k2, v2 = k.clone(), v.clone()
    k2[: 30 - window] += 5
    v2[: 30 - window] -= 5
    torch.testing.assert_close(sliding_window_attention(q, k2, v2, 0.5, window), out)
    v2 = v.clone()
    v2[-1] += 1  # the query's own position is inside every window
    assert not torch.allclose(sliding_window_attention(q, k, v2, 0.5, window), out)


# --- a whole Gemma 3 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), family="gemma3", seed=4, sliding_window=16)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_gemma3_logits_match_transformers(tiny_gemma):
    from minivllm.loader import load_model

    path, hf = tiny_gemma
    ours = load_model(path)
    ids = torch.randint(0, 512, (70,))
    reset_context()
    with torch.no_grad(), torch_threads(1):
        logits = ours.compute_logits(ours(ids, torch.arange(70)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
