"""Chapter 11 — more model families: Gemma's RMSNorm and the sliding-window mask.

Your ``gemma_rms_norm`` (exercises/minivllm/ops/norm.py) is checked against
transformers' own ``Gemma3RMSNorm`` on random inputs and weights (weights near zero, as
Gemma stores them, and far from it), in float32 and bfloat16 (Gemma rounds only once, at
the very end: a norm that rounds earlier is off by a bf16 ulp somewhere). Your
``sliding_window_attention`` (exercises/minivllm/ops/attention.py) is checked against an
explicitly masked softmax in float64 for random windows and lengths, as the tail of a
longer sequence (a decode step or a chunk) and from its start.

The main exercise is Gemma 3 itself, built from those pieces: its decoder layer
(``Gemma3DecoderLayer``'s modules and its sandwich of norms, exercises/minivllm/models/gemma3.py),
the local or global choice of every attention layer (``Qwen3Attention``, its RoPE base, scaling,
window and logit scale, exercises/minivllm/models/qwen3.py), the scaled embeddings
(``ScaledVocabEmbedding``, exercises/minivllm/layers/embed_head.py) and the final logit
softcapping. Each is checked on its own, then a tiny Gemma 3 (local layers with a window of
16 among global ones) must give transformers' logits on a prompt much longer than the window,
with and without softcapping.
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
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0,
                               msg="a tiny Gemma 3 (layer, norms, local and global attention, scaled embeddings) "
                                   "must give transformers' logits")


def tiny_gemma_config(**overrides):
    from minivllm.config import ModelConfig

    hf = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=64, hidden_size=32,
              intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window=16, query_pre_attn_scalar=16,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
              max_position_embeddings=64)
    return ModelConfig.from_dict(hf | overrides)


def test_ch11_gemma3_layer_has_the_checkpoints_modules():
    from minivllm.models.gemma3 import Gemma3DecoderLayer

    layer = Gemma3DecoderLayer(tiny_gemma_config(), 0)
    names = {name for name, _ in layer.named_parameters()}
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        assert f"{norm}.weight" in names, f"a Gemma 3 layer has four norms, named as the checkpoint names them: {norm}"
    from minivllm.layers.norm import GemmaRMSNorm

    assert all(isinstance(getattr(layer, n), GemmaRMSNorm) for n in ("input_layernorm", "post_feedforward_layernorm")), (
        "Gemma's norms scale by 1 + weight: GemmaRMSNorm, not RMSNorm")
    assert isinstance(layer.self_attn.q_norm, GemmaRMSNorm) and isinstance(layer.self_attn.k_norm, GemmaRMSNorm), (
        "the per-head q/k norm of Gemma 3 is Gemma's norm too")
    assert layer.mlp.act_fn.activation == "gelu_tanh", "Gemma 3's feed-forward is GeGLU with gelu's tanh approximation"


@pytest.mark.parametrize("layer_idx, local", [(0, True), (1, False), (2, True), (3, False)])
def test_ch11_each_layer_is_local_or_global_as_layer_types_says(layer_idx, local):
    from minivllm.layers.rotary import RotaryEmbedding
    from minivllm.models.gemma3 import Gemma3DecoderLayer

    config = tiny_gemma_config()
    attn = Gemma3DecoderLayer(config, layer_idx).self_attn
    window = attn.attn.sliding_window
    assert window == (16 if local else None), (
        f"layer {layer_idx} is {'local: a window of sliding_window' if local else 'global: no window'}, got {window}")
    base = 10_000.0 if local else 1_000_000.0
    ref = RotaryEmbedding(8, 64, base)
    assert torch.allclose(attn.rotary_emb.cos_cache, ref.cos_cache), (
        f"layer {layer_idx} must rotate with RoPE base {base:g} "
        f"({'rope_local_theta' if local else 'rope_theta'})")
    assert attn.attn.scale == pytest.approx(16 ** -0.5), "the logit scale is query_pre_attn_scalar ** -0.5 where it is set"


def test_ch11_local_layers_default_base_and_no_scaling():
    from minivllm.layers.rotary import RotaryEmbedding
    from minivllm.models.gemma3 import Gemma3DecoderLayer

    scaling = {"rope_type": "linear", "factor": 8.0}
    config = tiny_gemma_config(rope_local_base_freq=None, rope_scaling=scaling, query_pre_attn_scalar=None)
    local, glob = Gemma3DecoderLayer(config, 0).self_attn, Gemma3DecoderLayer(config, 1).self_attn
    assert torch.allclose(local.rotary_emb.cos_cache, RotaryEmbedding(8, 64, 10_000.0).cos_cache), (
        "a local layer without rope_local_theta rotates with base 10000, and never with the RoPE scaling")
    assert torch.allclose(glob.rotary_emb.cos_cache, RotaryEmbedding(8, 64, 1_000_000.0, scaling=scaling).cos_cache), (
        "a global layer rotates with rope_theta and the config's RoPE scaling")
    assert local.attn.scale == pytest.approx(8 ** -0.5), "without query_pre_attn_scalar the scale is head_dim ** -0.5"


def test_ch11_without_layer_types_every_layer_is_global():
    from minivllm.models.gemma3 import Gemma3DecoderLayer

    config = tiny_gemma_config(layer_types=None, sliding_window=None)
    for i in range(4):
        assert Gemma3DecoderLayer(config, i).self_attn.attn.sliding_window is None, (
            "a config without layer_types has only global layers")


@pytest.mark.parametrize("hidden", [32, 2048, 3840])
def test_ch11_scaled_embedding_rounds_its_factor_to_the_weights_dtype(hidden):
    from minivllm.layers.embed_head import ScaledVocabEmbedding

    emb = ScaledVocabEmbedding(4, hidden).to(torch.bfloat16)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(4, hidden, generator=torch.Generator().manual_seed(hidden)))
    out = emb(torch.tensor([0, 3]))
    factor = torch.tensor(hidden**0.5, dtype=torch.float32).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16, "the embeddings stay in the weights' dtype"
    assert torch.equal(out, emb.weight[[0, 3]] * factor), (
        f"each row is multiplied by sqrt(hidden_size) rounded to bfloat16 first ({factor.item()}), "
        f"as transformers does, not by {hidden ** 0.5}")


def test_ch11_scaled_embedding_float32():
    from minivllm.layers.embed_head import ScaledVocabEmbedding

    emb = ScaledVocabEmbedding(5, 9)
    with torch.no_grad():  # the layer is born with torch.empty: give it real numbers, never NaN
        emb.weight.copy_(torch.randn(5, 9, generator=torch.Generator().manual_seed(11)))
    ids = torch.tensor([4, 0, 4])
    torch.testing.assert_close(emb(ids), emb.weight[ids] * 3.0, msg="an embedding row times sqrt(hidden_size)")


@pytest.fixture(scope="module")
def tiny_gemma_softcapped(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3cap"), family="gemma3", seed=5, sliding_window=8,
                                final_logit_softcapping=0.5)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_ch11_gemma3_softcapped_logits_match_transformers(tiny_gemma_softcapped):
    from minivllm.loader import load_model

    path, hf = tiny_gemma_softcapped
    ours = load_model(path)
    ids = torch.randint(0, 512, (30,))
    reset_context()
    with torch.no_grad(), torch_threads(1):
        logits = ours.compute_logits(ours(ids, torch.arange(30)), all_tokens=True)
        last = ours.compute_logits(ours(ids, torch.arange(30)))
        ref = hf(ids[None]).logits[0]
    assert logits.abs().max() < 0.5, "softcapped logits lie strictly inside (-cap, cap)"
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0, msg="softcapping is tanh(logits / cap) * cap")
    torch.testing.assert_close(last, ref[-1:], atol=1e-4, rtol=0, msg="the last token's logits are capped too")
