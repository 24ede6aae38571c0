"""Qwen3-Next against transformers, float32, CPU.

Qwen3-Next runs Qwen3.5-MoE's layers; what is its own is the checkpoint's in-projections
grouped by key head (regrouped at load), the choice of sparse layers (``decoder_sparse_step``,
``mlp_only_layers``) and the ``norm_topk_prob`` switch. The tiny model has four layers
(three Gated DeltaNet, one full attention), two key heads with two value heads each (so a
load that ignored the grouping would put heads in the wrong place), layer 0's feed-forward
dense and the others eight experts of width 32 (two per token) beside a shared expert of
width 48. Logits: 1e-4 on O(1) logits, as test_parity_qwen3_5 (the same float32 math in
another order). Greedy tokens through the engine, batched, with chunked prefill splitting
prompts across steps and across the rule's 64-token chunks, must equal transformers'.
"""
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context
from minivllm.engine.state_pool import HybridCacheManager
from minivllm.engine.tp_worker import check_tensor_parallel
from minivllm.layers.moe import SparseMoeBlock
from minivllm.loader import load_model
from minivllm.models.qwen3 import Qwen3MLP
from minivllm.testing import make_tiny_checkpoint, torch_threads

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LENGTHS = (1, 5, 63, 64, 65, 130, 200, 7)  # around one and two chunks of 64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next"), family="qwen3_next", seed=8)


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


def test_engine_greedy_matches_batched_and_chunked(checkpoint, hf):
    """One batch of prompts from 1 to 200 tokens; a budget of 48 tokens per step splits the
    long ones over several steps, and prefills run beside decodes."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENGTHS]
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=200, block_size=8, max_num_batched_tokens=48,
              record_trace=True)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False)
            expected.append(ref[0, len(prompt):].tolist())
    assert [o.outputs[0].token_ids for o in outputs] == expected
    trace = llm.engine.trace
    assert any({"prefill", "decode"} <= {kind for *_, kind in r.seqs} for r in trace), "no mixed step"
    prefill_steps = {}
    for r in trace:
        for seq_id, _, kind in r.seqs:
            prefill_steps[seq_id] = prefill_steps.get(seq_id, 0) + (kind == "prefill")
    assert max(prefill_steps.values()) >= 4, "the 200-token prompt must be prefilled over several steps"
    manager = llm.engine.block_manager
    assert isinstance(manager, HybridCacheManager) and not manager.enable_prefix_caching
    assert manager.states.num_free_slots == manager.states.num_slots


def test_tensor_parallel_refused(checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size=2: hybrid models"):
        check_tensor_parallel(load_model(checkpoint).config, 2, "cpu")
