"""Qwen3-Next against transformers, float32, CPU.

Qwen3-Next runs Qwen3.5-MoE's layers; what is its own is the checkpoint's in-projections
grouped by key head (regrouped at load), the choice of sparse layers (``decoder_sparse_step``,
``mlp_only_layers``) and the ``norm_topk_prob`` switch. The tiny model has four layers
(three Gated DeltaNet, one full attention), two key heads with two value heads each (so a
load that ignored the grouping would put heads in the wrong place), layer 0's feed-forward
dense and the others eight experts of width 32 (two per token) beside a shared expert of
width 48. Logits: 1e-4 on O(1) logits, as test_parity_qwen3_5 (the same float32 math in
another order). The engine's greedy tokens and the tensor-parallel refusal are in
test_parity_hybrid, with the other hybrid families.
"""
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minivllm.context import reset_context
from minivllm.layers.moe import SparseMoeBlock
from minivllm.loader import load_model
from minivllm.models.qwen3 import Qwen3MLP
from minivllm.testing import make_tiny_checkpoint


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(hybrid_checkpoint):
    return hybrid_checkpoint("qwen3_next")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def logits_pair(ours, hf, length):
    ids = torch.randint(0, 512, (length,))
    reset_context()
    with torch.no_grad():
        return ours.compute_logits(ours(ids, torch.arange(length)), all_tokens=True), hf(ids[None]).logits[0]


def test_config_and_layers(checkpoint, hf):
    ours = load_model(checkpoint)
    config = ours.config
    assert config.model_type == "qwen3_next" and config.rotary_dim == 4  # a quarter of head_dim 16
    assert (config.decoder_sparse_step, config.mlp_only_layers, config.norm_topk_prob) == (1, [0], True)
    assert [layer.layer_type for layer in ours.model.layers] == [layer.block_type for layer in hf.model.layers]
    assert isinstance(ours.model.layers[0].mlp, Qwen3MLP)
    for layer in ours.model.layers[1:]:
        assert isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.renormalize and layer.mlp.shared_expert


def test_grouped_in_projections_regrouped(checkpoint, hf):
    """Our packed in_proj gives, for any input, the q, k, v, z, b, a that transformers'
    ``fix_query_key_value_ordering`` takes out of its two grouped projections."""
    ours = load_model(checkpoint)
    x = torch.randn(1, 9, 64)
    mine, theirs = ours.model.layers[0].linear_attn, hf.model.layers[0].linear_attn
    with torch.no_grad():
        q, k, v, z, b, a = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(x), theirs.in_proj_ba(x))
        expected = torch.cat([t.reshape(9, -1) for t in (q, k, v, z, b, a)], dim=-1)
        torch.testing.assert_close(mine.in_proj(x[0]), expected, atol=1e-6, rtol=0)
        # Read as if ungrouped, the rows would be in another order: the test can tell.
        ungrouped = torch.cat([theirs.in_proj_qkvz(x)[0], theirs.in_proj_ba(x)[0]], dim=-1)
        assert (ungrouped - expected).abs().max() > 1e-2


@pytest.mark.parametrize("length", [5, 64, 150])
def test_logits_match(checkpoint, hf, length):
    logits, ref = logits_pair(load_model(checkpoint), hf, length)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_sparse_step_and_unnormalised_router(tmp_path):
    """Another layout: every second layer sparse (1 and 3), the top-k probabilities not
    renormalised. Layers and logits as transformers'."""
    path = make_tiny_checkpoint(tmp_path, family="qwen3_next", seed=9, decoder_sparse_step=2, mlp_only_layers=[],
                                norm_topk_prob=False)
    ours, hf = load_model(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [False, True, False, True]
    assert sparse == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert not ours.model.layers[1].mlp.renormalize
    logits, ref = logits_pair(ours, hf, 70)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_misshapen_in_projection_is_named(checkpoint, tmp_path):
    state = load_file(checkpoint / "model.safetensors")
    name = "model.layers.1.linear_attn.in_proj_ba.weight"
    state[name] = state[name][:-1]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(ValueError, match=r"in_proj_ba\.weight.*shard 'ba': expected shape \(8, 64\)"):
        load_model(tmp_path)


