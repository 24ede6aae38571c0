"""Qwen3-MoE against transformers on tiny random checkpoints (float32, CPU), and the fused
MoE kernel against the reference loop over experts (Triton's interpreter).

Two checkpoints: "renorm" (norm_topk_prob on, every layer sparse) and "plain"
(norm_topk_prob off, four layers of which decoder_sparse_step=2 and mlp_only_layers=[3]
leave only layer 1 sparse). Logit tolerance as in test_parity_qwen3: the same float32 math
in another order, 1e-4 on O(1) logits. The kernel runs in the interpreter, which computes
in numpy float32: 1e-5 on O(1) outputs (a few float32 ulps of the sums over H and I).
"""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context
from minivllm.layers.moe import SparseMoeBlock, route
from minivllm.loader import load_model
from minivllm.ops import moe as moe_ops
from minivllm.ops.moe import experts_reference, fused_experts, group_by_expert
from minivllm.testing import make_tiny_checkpoint

VARIANTS = {
    "renorm": dict(norm_topk_prob=True),
    "plain": dict(norm_topk_prob=False, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"moe-{request.param}"), family="qwen3_moe", seed=11,
                                **VARIANTS[request.param])
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_config_and_layer_kinds(moe):
    name, path, hf = moe
    ours = load_model(path)
    config = ours.config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.norm_topk_prob == (name == "renorm") and config.qk_norm
    # Sparse exactly where transformers put its sparse blocks.
    ours_sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    hf_sparse = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert ours_sparse == hf_sparse
    assert ours_sparse == ([True, True] if name == "renorm" else [False, True, False, False])


def test_experts_stacked_from_per_expert_tensors(moe):
    _, path, hf = moe
    ours = load_model(path)
    for mine, theirs in zip(ours.model.layers, hf.model.layers):
        if isinstance(mine.mlp, SparseMoeBlock):
            torch.testing.assert_close(mine.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj, atol=0, rtol=0)
            torch.testing.assert_close(mine.mlp.experts.down_proj, theirs.mlp.experts.down_proj, atol=0, rtol=0)
            torch.testing.assert_close(mine.mlp.gate.weight, theirs.mlp.gate.weight, atol=0, rtol=0)


@pytest.mark.parametrize("length", [5, 300])
def test_logits_match(moe, length):
    _, path, hf = moe
    ours = load_model(path)
    ids = torch.randint(0, 512, (length,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(length)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_logits_match_through_the_fused_kernel(moe, monkeypatch):
    """The model with its experts in the Triton kernels (interpreter) instead of the loop."""
    _, path, hf = moe
    ours = load_model(path)
    monkeypatch.setattr(moe_ops, "use_triton", lambda x: True)
    calls = []
    import minivllm.kernels.fused_moe as kernels

    real = kernels.fused_moe
    monkeypatch.setattr(kernels, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, 512, (40,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(40)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
    assert len(calls) == sum(isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_engine_greedy_matches(moe):
    """Paged, batched, chunked (budget 64) and prefix-cached (shared prefix): identical."""
    _, path, hf = moe
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (1, 30, 150, 7)]
    prompts += [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 90, 200)]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=200, block_size=8, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert sum(o.num_cached_tokens for o in outputs) > 0


# -- checkpoint layouts --------------------------------------------------------------------


def test_fused_checkpoint_layout_loads_the_same(moe, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) saved as is: the same parameters as from the hub's per-expert tensors."""
    _, path, hf = moe
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    a, b = dict(load_model(path).named_parameters()), dict(load_model(tmp_path).named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_missing_expert_tensor_is_named(moe, tmp_path):
    _, path, _ = moe
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj\[\(5, 1\)\]"):
        load_model(tmp_path)


def test_misshapen_expert_tensor_is_named(moe, tmp_path):
    _, path, _ = moe
    from safetensors.torch import load_file

    state = load_file(path / "model.safetensors")
    state["model.layers.1.mlp.experts.2.down_proj.weight"] = torch.randn(64, 31)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"experts\.2\.down_proj.*expert 2: expected shape \(64, 32\)"):
        load_model(tmp_path)


def test_config_rejects_bad_top_k(moe, tmp_path):
    _, path, _ = moe
    config = json.loads((path / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be in \[1, num_experts=8\]"):
        load_model(tmp_path)


# -- the router ----------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_transformers_router(renormalize):
    hidden, experts, top_k = 32, 16, 4
    config = type("C", (), dict(num_experts_per_tok=top_k, num_experts=experts, norm_topk_prob=renormalize,
                                hidden_size=hidden))()
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(50, hidden)
    _, hf_weights, hf_ids = router(x)
    weights, ids = route(x @ router.weight.T, top_k, renormalize)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == renormalize


# -- grouping and the fused kernel (interpreter) --------------------------------------------


def random_routing(tokens, experts, top_k, idle=(), generator=None):
    """Random router choices (distinct experts per token) that never pick the ``idle`` experts."""
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, list(idle)] = float("-inf")
    probs = logits.softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("tokens,experts,top_k,block", [(1, 8, 2, 16), (13, 8, 2, 16), (40, 6, 3, 4), (7, 32, 4, 8)])
def test_group_by_expert(tokens, experts, top_k, block):
    _, ids = random_routing(tokens, experts, top_k, idle=[1])
    groups = group_by_expert(ids, experts, block)
    flat = ids.flatten()
    n = flat.numel()
    rows = groups.sorted_ids.view(-1, block)
    real = groups.sorted_ids[groups.sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every assignment exactly once
    assert (groups.sorted_ids[groups.sorted_ids >= n] == n).all()  # padding holds the sentinel
    seen = []
    for b, expert in enumerate(groups.block_experts.tolist()):
        members = rows[b][rows[b] < n]
        if expert < 0:
            assert members.numel() == 0
            continue
        assert members.numel() > 0 and (flat[members] == expert).all()  # one expert per block
        assert members.tolist() == sorted(members.tolist())  # token order kept within an expert
        seen.append(expert)
    assert seen == sorted(seen) and 1 not in seen  # experts in order, idle ones take no block
    counts = torch.bincount(flat, minlength=experts)
    assert [seen.count(e) for e in range(experts)] == ((counts + block - 1) // block).tolist()  # padding < block


def poisoned_empty(monkeypatch):
    """Every float buffer the kernel allocates starts as NaN: an unwritten row shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [(1, 32, 16, 8, 2), (13, 48, 40, 8, 2),
                                                               (37, 64, 24, 16, 4), (70, 32, 32, 4, 1)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_moe_matches_reference(monkeypatch, tokens, hidden, inter, experts, top_k, block_m):
    from minivllm.ops.moe import fused_experts_triton as fused_moe

    x = torch.randn(tokens, hidden)
    w_gate_up = torch.randn(experts, 2 * inter, hidden) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter) * inter**-0.5
    idle = [0, experts - 1] if experts > top_k + 2 else []  # experts that get zero tokens
    weights, ids = random_routing(tokens, experts, top_k, idle)
    ref = experts_reference(x, w_gate_up, w_down, weights, ids)
    poisoned_empty(monkeypatch)
    config = dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=16, num_warps=4)
    out = fused_moe(x, w_gate_up, w_down, weights, ids, config=config)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_reference_is_the_definition():
    """The loop over experts against the formula token by token."""
    tokens, hidden, inter, experts, top_k = 9, 16, 8, 5, 2
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.float64)
    w_down = torch.randn(experts, hidden, inter, dtype=torch.float64)
    weights, ids = random_routing(tokens, experts, top_k)
    weights = weights.double()
    out = experts_reference(x, w_gate_up, w_down, weights, ids)
    for t in range(tokens):
        expected = torch.zeros(hidden, dtype=torch.float64)
        for k in range(top_k):
            e = ids[t, k]
            gate, up = w_gate_up[e, :inter] @ x[t], w_gate_up[e, inter:] @ x[t]
            expected += weights[t, k] * (w_down[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], expected)


def test_bad_inputs_are_named(monkeypatch):
    x, w_gate_up, w_down = torch.randn(4, 8), torch.randn(3, 6, 8), torch.randn(3, 8, 3)
    weights, ids = random_routing(4, 3, 2)
    with pytest.raises(ValueError, match="w_down"):
        fused_experts(x, w_gate_up, torch.randn(3, 8, 4), weights, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fused_experts(x, w_gate_up, w_down, weights[:3], ids[:3])
    monkeypatch.setenv("MINIVLLM_MOE_BACKEND", "fast")
    with pytest.raises(ValueError, match="MINIVLLM_MOE_BACKEND='fast'"):
        fused_experts(x, w_gate_up, w_down, weights, ids)
