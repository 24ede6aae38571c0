"""Chapter 01 — the forward pass: RMSNorm and the SwiGLU gate.

Your ``rms_norm`` (exercises/minivllm/ops/norm.py) and ``silu_and_mul``
(exercises/minivllm/ops/activation.py) are compared with transformers' Qwen3RMSNorm and
with plain float64 math on random inputs of many shapes and dtypes, then run inside a whole
Qwen3 model whose logits must match transformers'.

Tolerances: float32 results may differ from the reference by the order of operations
(``x / sqrt`` against ``x * rsqrt``, a different summation order), a few ulps, so 1e-5
relative; bfloat16 and float16 results two units in the last place of the dtype (1.6e-2
and 2e-3 relative). One test then counts the low-precision outputs that differ from
transformers' at all: RMSNorm must round where transformers rounds (the normalised row to
the activations' dtype, then the weight), or an engine in bfloat16 drifts from it.

Also graded: the loader's loop and its name mapping (exercises/minivllm/loader.py), on
checkpoints that are sharded, carry extra, missing or misshapen tensors, or sit under a
prefix; and the decoder layer and stack (exercises/minivllm/models/qwen3.py), layer by
layer against transformers' hidden states.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from minivllm.context import reset_context
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.norm import RMSNorm
from minivllm.loader import load_model
from minivllm.ops.activation import silu_and_mul
from minivllm.ops.norm import rms_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) per dtype, see the module docstring.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-5)}


def assert_close(actual, expected):
    assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual).__name__}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype}, expected {expected.dtype}"
    rtol, atol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def random_tensor(shape, dtype, seed, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def hf_rms_norm(x, weight, eps):
    norm = Qwen3RMSNorm(x.shape[-1], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


# --- rms_norm -------------------------------------------------------------------------

shapes = st.tuples(
    st.lists(st.integers(1, 4), min_size=0, max_size=2),  # leading dims: tokens, heads
    st.sampled_from([1, 2, 7, 16, 64, 100]),  # the normalised (hidden) dim
)


@settings(max_examples=30)
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2, 1.0]),
    scale=st.sampled_from([1e-2, 1.0, 20.0]),
    offset=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**31),
)
def test_ch01_rms_norm_matches_transformers(shape, dtype, eps, scale, offset, seed):
    leading, hidden = shape
    x = random_tensor((*leading, hidden), dtype, seed, scale, offset * scale)
    weight = random_tensor((hidden,), dtype, seed + 1, 0.5, 1.0)
    before = x.clone()
    out = rms_norm(x, weight, eps)
    assert torch.equal(x, before), "rms_norm must not change its input"
    assert_close(out, hf_rms_norm(x, weight, eps))


def test_ch01_rms_norm_uses_eps():
    # Small activations, where eps decides the answer; a row of zeros must give zeros, not nan.
    x = random_tensor((3, 32), torch.float32, 0, scale=1e-3)
    x[1] = 0.0
    weight = random_tensor((32,), torch.float32, 1, 0.5, 1.0)
    for eps in (1e-6, 1e-2):
        assert_close(rms_norm(x, weight, eps), hf_rms_norm(x, weight, eps))


def test_ch01_rms_norm_is_not_layer_norm():
    # A large common offset: RMSNorm keeps it (the output is nearly constant), LayerNorm removes it.
    x = random_tensor((4, 64), torch.float32, 2, scale=0.1, offset=3.0)
    weight = random_tensor((64,), torch.float32, 3, 0.5, 1.0)
    assert_close(rms_norm(x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6))


def test_ch01_rms_norm_statistics_in_float32():
    # float16 tops out at 65504: squares of activations in the hundreds overflow it, so the
    # mean of squares must be taken in float32 (and the result returned as float16).
    x = random_tensor((2, 128), torch.float16, 4, scale=300.0)
    weight = random_tensor((128,), torch.float16, 5, 0.5, 1.0)
    out = rms_norm(x, weight, 1e-6)
    assert torch.isfinite(out).all(), "inf or nan: were the statistics computed in float16?"
    assert_close(out, hf_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_ch01_rms_norm_rounds_like_transformers(dtype):
    # transformers rounds the normalised row to x's dtype *before* the weight multiplies it
    # (two roundings). Multiplying the float32 row by the weight and rounding once is off
    # by at most one ulp, inside the tolerance above, but in about a quarter of the values.
    # x / sqrt(...) for x * rsqrt(...), or a sum over n for the mean, changes none of these;
    # the 1% allowance leaves room for other orders of the float32 arithmetic.
    x = random_tensor((64, 96), dtype, 6, scale=4.0)
    weight = random_tensor((96,), dtype, 7, 0.5, 1.0)
    out = rms_norm(x, weight, 1e-6)
    expected = hf_rms_norm(x, weight, 1e-6)
    assert_close(out, expected)
    differ = (out != expected).float().mean().item()
    assert differ < 0.01, (
        f"{differ:.0%} of the {dtype} outputs differ from transformers' by a rounding: cast the normalised row back "
        "to x's dtype before multiplying by the weight, as transformers does")


def test_ch01_rms_norm_module_with_residual():
    # The module adds the residual first, then normalises: (norm(x + r), x + r).
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48) * 0.5 + 1)
    x, residual = torch.randn(5, 48), torch.randn(5, 48)
    out, new_residual = norm(x, residual)
    assert_close(new_residual, x + residual)
    assert_close(out, hf_rms_norm(x + residual, norm.weight.detach(), 1e-5))


# --- silu_and_mul ---------------------------------------------------------------------


def reference_silu_and_mul(x):
    """SwiGLU's gate in float64: x = [gate | up], silu(gate) * up, silu(g) = g * sigmoid(g)."""
    gate, up = x.double().split(x.shape[-1] // 2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


@settings(max_examples=30)
@given(
    leading=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    half=st.sampled_from([1, 3, 8, 64]),
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([0.1, 1.0, 8.0]),
    seed=st.integers(0, 2**31),
)
def test_ch01_silu_and_mul_matches_reference(leading, half, dtype, scale, seed):
    x = random_tensor((*leading, 2 * half), dtype, seed, scale)
    before = x.clone()
    out = silu_and_mul(x)
    assert torch.equal(x, before), "silu_and_mul must not change its input"
    assert_close(out, reference_silu_and_mul(x))


def test_ch01_silu_and_mul_gate_is_the_first_half():
    # gate = [-4, 0, 4], up = [1, 1, 1]: silu(gate); swapping gate and up gives silu(1) * gate.
    x = torch.tensor([[-4.0, 0.0, 4.0, 1.0, 1.0, 1.0]])
    assert_close(SiluAndMul()(x), F.silu(torch.tensor([[-4.0, 0.0, 4.0]])))


# --- the whole model ------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 13])
def test_ch01_qwen3_logits_match_transformers(tiny_qwen3, hf_qwen3, length):
    # Both sides compute the same float32 math in a different order (packed projections,
    # another attention kernel): logits of order 1 agree to ~1e-6; 1e-4 leaves room for
    # that and none for a wrong norm or gate, which moves logits by ~1e-1.
    model = load_model(tiny_qwen3)
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    reset_context()
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(length)), all_tokens=True)
        expected = hf_qwen3(ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


# --- the loader -----------------------------------------------------------------------

from pathlib import Path  # noqa: E402
import shutil  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402

from minivllm.loader import _param_name_and_shard, load_weights  # noqa: E402
from minivllm.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from minivllm.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from minivllm.testing import make_tiny_checkpoint  # noqa: E402

PACKED = Qwen3ForCausalLM.packed_modules_mapping
EXPERTS = Qwen3MoeForCausalLM.expert_modules_mapping


@pytest.mark.parametrize("ckpt_name, expected", [
    ("model.layers.0.self_attn.q_proj.weight", ("model.layers.0.self_attn.qkv_proj.weight", "q")),
    ("model.layers.2.self_attn.v_proj.bias", ("model.layers.2.self_attn.qkv_proj.bias", "v")),
    ("model.layers.1.mlp.gate_proj.weight", ("model.layers.1.mlp.gate_up_proj.weight", 0)),
    ("model.layers.1.mlp.up_proj.weight", ("model.layers.1.mlp.gate_up_proj.weight", 1)),
    ("model.layers.0.self_attn.o_proj.weight", ("model.layers.0.self_attn.o_proj.weight", None)),
    ("model.layers.0.mlp.down_proj.weight", ("model.layers.0.mlp.down_proj.weight", None)),
    ("model.layers.0.self_attn.xq_proj.weight", ("model.layers.0.self_attn.xq_proj.weight", None)),
    ("model.embed_tokens.weight", ("model.embed_tokens.weight", None)),
])
def test_ch01_packed_names(ckpt_name, expected):
    got = _param_name_and_shard(ckpt_name, PACKED, EXPERTS)
    assert got == expected, (
        f"{ckpt_name} must go to {expected} (a packed projection is renamed to its packed parameter, with its "
        f"shard id; a part matches only as a whole dotted component; anything else keeps its name), got {got}")


@pytest.mark.parametrize("ckpt_name, expected", [
    ("model.layers.3.mlp.experts.7.down_proj.weight", ("model.layers.3.mlp.experts.down_proj", (7, None))),
    ("model.layers.0.mlp.experts.12.up_proj.weight", ("model.layers.0.mlp.experts.gate_up_proj", (12, 1))),
    ("model.layers.0.mlp.experts.0.gate_proj.weight", ("model.layers.0.mlp.experts.gate_up_proj", (0, 0))),
])
def test_ch01_expert_tensors_go_to_the_stacked_parameter(ckpt_name, expected):
    name, shard = expected
    expected = (name, (shard[0], EXPERTS[ckpt_name.split(".")[-2]][1]))
    got = _param_name_and_shard(ckpt_name, PACKED, EXPERTS)
    assert got == expected, f"one expert's projection goes to the stacked parameter at (expert as an int, part): {got}"
    assert isinstance(got[1][0], int), "the expert number must be an int, not the string from the name"


def rewritten(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint at src whose tensors are edit(tensors) (a dict in, a dict out)."""
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
        file.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(edit(dict(tensors)), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def fresh_model(path):
    from minivllm.config import ModelConfig

    with torch.device("cpu"):
        return Qwen3ForCausalLM(ModelConfig.from_pretrained(path)).float()


def assert_same_weights(model, reference):
    theirs = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, theirs[name]), f"parameter {name} was not loaded as in the reference"


def test_ch01_load_weights_loads_every_tensor(tiny_qwen3):
    model = fresh_model(tiny_qwen3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_weights(model, tiny_qwen3)
    tensors = load_file(next(Path(tiny_qwen3).glob("*.safetensors")))
    params = dict(model.named_parameters())
    assert torch.equal(params["model.layers.0.mlp.down_proj.weight"], tensors["model.layers.0.mlp.down_proj.weight"]), \
        "a tensor that is not packed goes to the parameter of its own name"
    for name, p in params.items():
        assert not p.isnan().any(), f"{name} was left unloaded"


def test_ch01_load_weights_reads_every_shard(tmp_path):
    # A checkpoint in several files (with a shard index): every file's tensors count.
    sharded = make_tiny_checkpoint(tmp_path / "sharded", family="qwen3", seed=0, max_shard_size=20_000)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    whole = make_tiny_checkpoint(tmp_path / "whole", family="qwen3", seed=0)
    model = fresh_model(sharded)
    load_weights(model, sharded)
    reference = fresh_model(whole)
    load_weights(reference, whole)
    assert_same_weights(model, reference)


def test_ch01_load_weights_rejects_an_unknown_tensor(tiny_qwen3, tmp_path):
    path = rewritten(tiny_qwen3, tmp_path / "extra", lambda t: {**t, "model.layers.0.bogus.weight": torch.zeros(3)})
    with pytest.raises(KeyError) as error:
        load_weights(fresh_model(tiny_qwen3), path)
    assert "model.layers.0.bogus.weight" in str(error.value) and "model.safetensors" in str(error.value), \
        f"a tensor with no place in the model is a KeyError naming it and its file: {error.value}"


@pytest.mark.parametrize("dropped, named", [
    ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
    ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj.weight[k]"),
    ("model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight[1]"),
])
def test_ch01_load_weights_names_a_missing_tensor(tiny_qwen3, tmp_path, dropped, named):
    path = rewritten(tiny_qwen3, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != dropped})
    with pytest.raises(KeyError) as error:
        load_weights(fresh_model(tiny_qwen3), path)
    message = str(error.value)
    assert named in message, f"a checkpoint without {dropped} must fail naming {named} (a packed piece with its shard): {message}"
    assert message.count("model.") == 1, f"only the missing piece is named, not the pieces that were loaded: {message}"


def test_ch01_load_weights_names_a_misshapen_tensor(tiny_qwen3, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    path = rewritten(tiny_qwen3, tmp_path / "shape", lambda t: {**t, name: t[name][:, :-1].contiguous()})
    with pytest.raises(ValueError) as error:
        load_weights(fresh_model(tiny_qwen3), path)
    assert name in str(error.value), f"a tensor of the wrong shape is a ValueError naming it: {error.value}"


def test_ch01_load_weights_skips_what_is_not_the_model(tiny_qwen3, tmp_path):
    # The multi-token-prediction head, a recomputed rotary table, and the LM head of a model
    # whose LM head is its embedding: none of them has a place, none of them is an error.
    extra = {"mtp.layers.0.mlp.down_proj.weight": torch.zeros(2, 2),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    path = rewritten(tiny_qwen3, tmp_path / "skips", lambda t: {**t, **extra, "lm_head.weight": torch.zeros_like(
        t["model.embed_tokens.weight"])})
    model = fresh_model(tiny_qwen3)
    assert model.config.tie_word_embeddings
    load_weights(model, path)
    reference = fresh_model(tiny_qwen3)
    load_weights(reference, tiny_qwen3)
    assert_same_weights(model, reference)


def test_ch01_load_weights_with_a_prefix(tiny_qwen3, tmp_path):
    # prefix="mtp.": only the tensors under it, known by the rest of their names.
    path = rewritten(tiny_qwen3, tmp_path / "prefixed", lambda t: {
        **{"mtp." + k: v for k, v in t.items()}, "model.norm.weight": torch.full_like(t["model.norm.weight"], 7.0)})
    model = fresh_model(tiny_qwen3)  # (the config is checked against the weights: the clean checkpoint's)
    load_weights(model, path, prefix="mtp.")
    reference = fresh_model(tiny_qwen3)
    load_weights(reference, tiny_qwen3)
    assert_same_weights(model, reference)
    partial = rewritten(path, tmp_path / "prefixed_partial",
                        lambda t: {k: v for k, v in t.items() if k != "mtp.model.norm.weight"})
    with pytest.raises(KeyError) as error:
        load_weights(fresh_model(tiny_qwen3), partial, prefix="mtp.")
    assert "mtp.model.norm.weight" in str(error.value), f"a missing tensor is named with its prefix: {error.value}"


def test_ch01_load_weights_untied_head(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "untied", family="qwen3", seed=3, tie_word_embeddings=False)
    model = fresh_model(path)
    load_weights(model, path)
    tensors = load_file(next(Path(path).glob("*.safetensors")))
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"]), "an untied LM head is loaded from lm_head.weight"


# --- the decoder layer and the stack ------------------------------------------------------


def test_ch01_decoder_layers_match_transformers_layer_by_layer(tiny_qwen3, hf_qwen3):
    # The hidden states after every layer, residual added back, as transformers computes them.
    model = load_model(tiny_qwen3)
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(9))
    positions = torch.arange(9)
    reset_context()
    with torch.no_grad():
        expected = hf_qwen3(ids[None], output_hidden_states=True).hidden_states
        hidden = model.model.embed_tokens(ids)
        residual = None
        for i, layer in enumerate(model.model.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i + 1 == len(model.model.layers):
                break  # transformers' last hidden state is after the final norm
            torch.testing.assert_close(hidden + residual, expected[i + 1][0], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"after layer {i}, the layer's output plus its residual: {m}")
        final = model.model(ids, positions)
    torch.testing.assert_close(final, expected[-1][0], rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"the stack's output is the final norm of the last residual: {m}")

