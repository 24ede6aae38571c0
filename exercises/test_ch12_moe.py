"""Chapter 12 — mixture of experts: the router, and grouping tokens by expert.

Your ``route`` (exercises/minivllm/layers/moe.py) is checked against transformers' own
``Qwen3MoeTopKRouter`` on random hidden states, with and without renormalisation, and by
its properties (the chosen experts are the most probable ones, best first; renormalised
weights sum to one; plain ones are the softmax probabilities themselves). Your
``group_by_expert`` (exercises/minivllm/ops/moe.py) is checked by its contract on random
routings (every assignment exactly once; each block one expert's, in expert and token
order; idle experts take no block; padding holds the sentinel and stays under a block per
expert), then it drives the fused Triton MoE kernel (in Triton's interpreter on the CPU)
whose output must equal the reference loop over experts.

The main exercise is the combine, ``experts_reference`` (exercises/minivllm/ops/moe.py):
checked against a token-by-token spec written in the test (every token, every choice), on
random routings with idle experts, with weights that differ per slot, in float32 and
bfloat16; and the block's ``forward`` (exercises/minivllm/layers/moe.py), router, experts and
the gated shared expert, against the same spec. Finally a tiny Qwen3-MoE must give
transformers' logits.
"""
import os
import sys


def _interpret_triton() -> None:
    """Run the Triton kernels in the interpreter (see test_ch09_triton.py for why)."""
    os.environ["TRITON_INTERPRET"] = "1"
    language = sys.modules.get("triton.language")
    if language is not None and type(language.sum).__name__ != "InterpretedFunction":
        for name in [n for n in sys.modules if n.split(".")[0] == "triton" and not n.startswith("triton._C")]:
            del sys.modules[name]
        for name in [n for n in sys.modules if n.startswith("minivllm.kernels")]:
            del sys.modules[name]


_interpret_triton()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter  # noqa: E402

from minivllm.context import reset_context  # noqa: E402
from minivllm.layers.moe import route  # noqa: E402
from minivllm.ops.moe import experts_reference, group_by_expert  # noqa: E402
from minivllm.testing import make_tiny_checkpoint, torch_threads  # noqa: E402

# --- the router -----------------------------------------------------------------------------


@given(tokens=st.integers(1, 20), experts=st.integers(2, 24), k_frac=st.floats(0, 1), renormalize=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_route_matches_transformers(tokens, experts, k_frac, renormalize, seed):
    top_k = max(1, round(experts * k_frac))
    hidden = 16
    config = type("Config", (), dict(num_experts_per_tok=top_k, num_experts=experts, norm_topk_prob=renormalize,
                                     hidden_size=hidden))()
    router = Qwen3MoeTopKRouter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=g))
        x = torch.randn(tokens, hidden, generator=g)
        _, hf_weights, hf_ids = router(x)
        weights, ids = route(x @ router.weight.T, top_k, renormalize)
    assert ids.shape == (tokens, top_k) and weights.shape == (tokens, top_k), (
        f"route must return two [tokens, top_k] = [{tokens}, {top_k}] tensors, got {tuple(weights.shape)}, {tuple(ids.shape)}"
    )
    assert torch.equal(ids, hf_ids), "the chosen experts differ from transformers' (top-k of the softmax, best first)"
    torch.testing.assert_close(weights, hf_weights)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_properties(renormalize):
    torch.manual_seed(3)
    logits = torch.randn(30, 10) * 2
    weights, ids = route(logits, 3, renormalize)
    probs = logits.softmax(-1)
    assert torch.equal(ids, probs.argsort(-1, descending=True)[:, :3]), "the top 3 experts, most probable first"
    chosen = probs.gather(1, ids)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(30))
        torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    else:
        torch.testing.assert_close(weights, chosen)  # the probabilities themselves: they sum to less than one
    assert weights.dtype == logits.dtype


def test_route_softmax_in_float32():
    """bf16 logits: the softmax is taken in float32 and only the result rounded to bf16."""
    torch.manual_seed(4)
    logits = (torch.randn(64, 32) * 3).bfloat16()
    weights, ids = route(logits, 4, True)
    probs = logits.float().softmax(-1)
    top, top_ids = probs.topk(4, dim=-1)
    assert torch.equal(ids, top_ids)
    assert weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights, (top / top.sum(-1, keepdim=True)).bfloat16(), atol=0, rtol=0)


# --- grouping by expert ---------------------------------------------------------------------


def random_routing(tokens, experts, top_k, idle, generator):
    logits = torch.randn(tokens, experts, generator=generator)
    logits[:, list(idle)] = float("-inf")
    return logits.softmax(-1).topk(top_k, dim=-1)


def check_groups(groups, ids, experts, block):
    flat = ids.flatten()
    n = flat.numel()
    sorted_ids, block_experts = groups.sorted_ids, groups.block_experts
    assert sorted_ids.numel() % block == 0 and block_experts.numel() == sorted_ids.numel() // block, (
        "sorted_ids must hold whole blocks, and block_experts one entry per block"
    )
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n)), "every assignment t * K + k must appear exactly once"
    assert bool((sorted_ids[sorted_ids >= n] == n).all()), "padding rows must hold the sentinel T * K"
    seen = []
    for b, expert in enumerate(block_experts.tolist()):
        members = sorted_ids[b * block : (b + 1) * block]
        members = members[members < n]
        if expert < 0:
            assert members.numel() == 0, f"block {b} is marked -1 (past the end) but holds assignments"
            continue
        assert members.numel() > 0, f"block {b} (expert {expert}) holds no assignment: an empty expert took a block"
        assert bool((flat[members] == expert).all()), f"block {b} mixes experts or is labelled with the wrong one"
        assert members.tolist() == sorted(members.tolist()), "within an expert, assignments keep token order"
        seen.append(expert)
    assert seen == sorted(seen), "blocks must come in expert order"
    counts = torch.bincount(flat, minlength=experts)
    assert [seen.count(e) for e in range(experts)] == ((counts + block - 1) // block).tolist(), (
        "each expert gets ceil(count / block_size) blocks"
    )


@given(tokens=st.integers(1, 40), experts=st.integers(2, 16), top_k=st.integers(1, 4),
       block=st.sampled_from([1, 2, 4, 16]), idle=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_group_by_expert_contract(tokens, experts, top_k, block, idle, seed):
    top_k = min(top_k, experts)
    idle_experts = list(range(min(idle, experts - top_k)))
    g = torch.Generator().manual_seed(seed)
    _, ids = random_routing(tokens, experts, top_k, idle_experts, g)
    check_groups(group_by_expert(ids, experts, block), ids, experts, block)


def test_group_by_expert_small_example():
    """Three tokens, top-2 of 4 experts, blocks of 2: experts 0, 1 and 3 busy, 2 idle."""
    ids = torch.tensor([[3, 0], [0, 1], [3, 0]])  # assignments 0..5 = (t0,3) (t0,0) (t1,0) (t1,1) (t2,3) (t2,0)
    groups = group_by_expert(ids, 4, 2)
    n = 6
    assert groups.sorted_ids.tolist()[:8] == [1, 2, 5, n, 3, n, 0, 4]
    assert groups.block_experts.tolist()[:4] == [0, 0, 1, 3]
    assert all(e == -1 for e in groups.block_experts.tolist()[4:])


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (21, 8, 2), (33, 16, 4)])
def test_fused_kernel_with_your_grouping(tokens, experts, top_k):
    from minivllm.ops.moe import fused_experts_triton as fused_moe

    hidden, inter = 32, 24
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    weights, ids = random_routing(tokens, experts, top_k, [0, 5], g)
    out = fused_moe(x, w_gate_up, w_down, weights, ids, config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4))
    torch.testing.assert_close(out, experts_reference(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5)


# --- the combine ------------------------------------------------------------------------------


def combine_spec(x, w_gate_up, w_down, weights, ids):
    """Token by token, choice by choice: what every token's output must be."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w_down.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w_gate_up[e].double() @ x[t].double()
            y = w_down[e].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:])
            out[t] += float(weights[t, k]) * y
    return out


def random_experts(tokens, experts, top_k, hidden=16, inter=12, seed=0, idle=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    weights, ids = random_routing(tokens, experts, top_k, list(idle), g)
    return x, w_gate_up, w_down, weights, ids


@given(tokens=st.integers(1, 12), experts=st.integers(1, 8), top_k=st.integers(1, 3), idle=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
def test_ch12_experts_reference_matches_the_spec(tokens, experts, top_k, idle, seed):
    top_k = min(top_k, experts)
    idle = range(min(idle, experts - top_k))
    x, w_gate_up, w_down, weights, ids = random_experts(tokens, experts, top_k, seed=seed, idle=idle)
    out = experts_reference(x, w_gate_up, w_down, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype, "the combine returns [tokens, hidden] in x's dtype"
    torch.testing.assert_close(out.double(), combine_spec(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5,
                               msg="out[t] = sum over k of weight[t, k] * expert_{ids[t, k]}(x[t]), "
                                   "each expert a SwiGLU: down @ (silu(gate @ x) * (up @ x))")


def test_ch12_experts_reference_weights_each_slot_by_its_own_weight():
    x, w_gate_up, w_down, _, _ = random_experts(3, 4, 2, seed=1)
    ids = torch.tensor([[2, 0], [0, 2], [1, 3]])  # expert 0 and 2 chosen in the first slot by one token, second by another
    weights = torch.tensor([[0.9, 0.1], [0.3, 0.7], [0.5, 0.5]])
    torch.testing.assert_close(experts_reference(x, w_gate_up, w_down, weights, ids).double(),
                               combine_spec(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5,
                               msg="each (token, expert) row is weighted by the slot in which that token chose it")


def test_ch12_experts_reference_an_expert_chosen_by_every_token_accumulates():
    x, w_gate_up, w_down, _, _ = random_experts(5, 3, 1, seed=2)
    ids = torch.zeros(5, 1, dtype=torch.long)
    weights = torch.full((5, 1), 0.5)
    out = experts_reference(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(out.double(), combine_spec(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5,
                               msg="all tokens on one expert: each token's row lands at its own index")
    out2 = experts_reference(x, w_gate_up, w_down, torch.full((5, 2), 0.5), torch.tensor([[0, 1]] * 5))
    spec2 = combine_spec(x, w_gate_up, w_down, torch.full((5, 2), 0.5), torch.tensor([[0, 1]] * 5))
    torch.testing.assert_close(out2.double(), spec2, atol=1e-5, rtol=1e-5,
                               msg="two experts' rows for the same token must add up, not overwrite each other")


def test_ch12_experts_reference_idle_experts_and_bfloat16():
    x, w_gate_up, w_down, weights, ids = random_experts(6, 5, 2, seed=3, idle=(0, 1, 2))
    w_gate_up[:3] = float("nan")  # idle experts: their weights must not even be read
    w_down[:3] = float("nan")
    out = experts_reference(x, w_gate_up, w_down, weights, ids)
    assert not out.isnan().any(), "an expert that no token chose is skipped: its weights are never read"
    b = [t.to(torch.bfloat16) for t in (x, w_gate_up[3:], w_down[3:])]
    out = experts_reference(b[0], b[1], b[2], weights, ids - 3)
    assert out.dtype == torch.bfloat16, "a bfloat16 model's combine stays in bfloat16"
    torch.testing.assert_close(out.double(), combine_spec(b[0], b[1], b[2], weights, ids - 3), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("shared", [0, 20])
@pytest.mark.parametrize("renormalize", [False, True])
def test_ch12_sparse_moe_block_forward(shared, renormalize):
    from minivllm.layers.moe import SparseMoeBlock

    torch.manual_seed(5)
    block = SparseMoeBlock(16, 6, 2, 12, renormalize, shared_expert_intermediate_size=shared)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    x = torch.randn(7, 16)
    with torch.no_grad():
        out = block(x)
        probs = (x @ block.gate.weight.T).softmax(-1)
        weights, ids = probs.topk(2, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        spec = combine_spec(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
        if shared:
            mlp = block.shared_expert
            gate, up = (x @ mlp.gate_up_proj.weight.T).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T
            spec = spec + (torch.sigmoid(x @ block.shared_expert_gate.weight.T) * y).double()
    assert out.shape == x.shape, "the block maps [tokens, hidden] to [tokens, hidden]"
    what = "plus the shared expert, scaled per token by the sigmoid of its gate" if shared else "no shared expert"
    torch.testing.assert_close(out.double(), spec, atol=1e-5, rtol=1e-5,
                               msg=f"the block: route the gate's logits, combine the experts ({what})")


# --- a whole Qwen3-MoE --------------------------------------------------------------------------


def test_qwen3_moe_logits_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from minivllm.loader import load_model

    path = make_tiny_checkpoint(tmp_path, family="qwen3_moe", seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path)
    ids = torch.randint(0, 512, (30,))
    reset_context()
    with torch.no_grad(), torch_threads(1):
        logits = ours.compute_logits(ours(ids, torch.arange(30)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0,
                               msg="a tiny Qwen3-MoE (router, experts, combine) must give transformers' logits")
