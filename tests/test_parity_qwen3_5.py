"""Qwen3.5 (hybrid: Gated DeltaNet + full attention) against transformers, float32, CPU.

The tiny model has four layers: three linear-attention (Gated DeltaNet) and one full
attention. Prompts shorter and longer than one chunk of the chunked form (64 tokens), with
preemption, must give transformers' greedy tokens exactly (batched with chunked prefill:
test_parity_hybrid, with the other hybrid families). Logits: 1e-4 on O(1) logits, as test_parity_qwen3 (the same float32 math in a
different order: chunked sums, a triangular solve instead of a loop).
"""
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context
from minivllm.engine.state_pool import HybridCacheManager, StatePool
from minivllm.engine.sequence import Sequence
from minivllm.layers.gated_deltanet import GatedDeltaNet
from minivllm.loader import load_model
from minivllm.ops.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_chunk,
    prepare_qk,
    recurrent_gated_delta_rule,
)

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LENGTHS = (1, 5, 63, 64, 65, 130, 200, 7)  # around one and two chunks of 64


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(hybrid_checkpoint):
    return hybrid_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False)
            out.append(ref[0, len(prompt):].tolist())
    return out


# -- the rule itself --------------------------------------------------------------------


def random_rule_inputs(length, num_k_heads=2, num_v_heads=4, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, num_k_heads, dk, generator=g)
    k = torch.randn(length, num_k_heads, dk, generator=g)
    v = torch.randn(length, num_v_heads, dv, generator=g)
    decay = -torch.rand(length, num_v_heads, generator=g) * 2  # log decays in (-2, 0]
    beta = torch.rand(length, num_v_heads, generator=g)
    state = torch.randn(num_v_heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 7, 64, 65, 150])
def test_chunked_form_equals_naive_recurrence(length):
    q, k, v, decay, beta, state = random_rule_inputs(length)
    qp, kp = prepare_qk(q, k, v.shape[1])
    naive_out, naive_state = recurrent_gated_delta_rule(qp, kp, v, decay, beta, state)
    out, final = chunk_gated_delta_rule(qp, kp, v, decay, beta, state)
    torch.testing.assert_close(out, naive_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, naive_state, atol=1e-5, rtol=1e-5)
    # Any chunk size is the same computation.
    out7, final7 = chunk_gated_delta_rule(qp, kp, v, decay, beta, state, chunk_size=7)
    torch.testing.assert_close(out7, naive_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final7, naive_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 70])
def test_rule_equals_transformers_reference(length):
    """Our naive recurrence and our chunked form against transformers' own torch fallbacks
    (which take raw q, k with use_qk_l2norm_in_kernel and a batch dimension)."""
    q, k, v, decay, beta, state = random_rule_inputs(length, seed=1)
    qp, kp = prepare_qk(q, k, v.shape[1])
    args = dict(initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = hf_qwen3_5.torch_chunk_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None], **args)
    out, final = chunk_gated_delta_rule(qp, kp, v, decay, beta, state)
    torch.testing.assert_close(out, ref_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_state[0], atol=1e-5, rtol=1e-5)
    ref_out, ref_state = hf_qwen3_5.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None], **args)
    out, final = recurrent_gated_delta_rule(qp, kp, v, decay, beta, state)
    torch.testing.assert_close(out, ref_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_state[0], atol=1e-5, rtol=1e-5)


def test_one_chunk_from_a_state_equals_steps():
    q, k, v, decay, beta, state = random_rule_inputs(20, seed=2)
    qp, kp = prepare_qk(q, k, v.shape[1])
    out, final = gated_delta_chunk(qp, kp, v, decay, beta, state)
    ref_out, ref_state = recurrent_gated_delta_rule(qp, kp, v, decay, beta, state)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [1, 2, 3, 9])
def test_causal_conv1d_carries_its_state(split):
    """The conv of a whole sequence equals the conv of its pieces with the state carried
    (pieces shorter than the kernel included), and equals transformers' causal_conv1d_fn."""
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(10, 6, generator=g), torch.randn(6, 4, generator=g)
    whole, _ = causal_conv1d(x, weight, torch.zeros(6, 3))
    ref = hf_qwen3_5.causal_conv1d_fn(x.T[None], weight, None, activation=None)[0].T
    torch.testing.assert_close(whole, ref)
    state, pieces = torch.zeros(6, 3), []
    for part in x.split(split):
        out, state = causal_conv1d(part, weight, state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), whole)
    torch.testing.assert_close(state, x[-3:].T)


# -- the model ---------------------------------------------------------------------------


def test_config(checkpoint):
    model = load_model(checkpoint)
    config = model.config
    assert config.model_type == "qwen3_5_text" and config.rotary_dim == 4  # 0.25 of head_dim 16
    kinds = [layer.layer_type for layer in model.model.layers]
    assert kinds == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    gdn = model.model.layers[0].linear_attn
    assert isinstance(gdn, GatedDeltaNet)
    assert gdn.state_shapes() == ((2 * 32 + 64, 3), (4, 16, 16))


@pytest.mark.parametrize("length", [5, 64, 150])
def test_logits_match(checkpoint, hf, length):
    ours = load_model(checkpoint)
    ids = torch.randint(0, 512, (length,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(length)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_engine_greedy_matches_with_preemption(checkpoint, prompts, reference):
    """A KV pool too small for the batch: sequences are preempted, give their state slot
    back, and are recomputed from scratch later in whatever slot is free."""
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=28, block_size=8, max_num_batched_tokens=64,
              max_num_seqs=6, record_trace=True)
    engine = llm.engine
    params = [GREEDY] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, request_id=str(i))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants(engine.scheduler.running)
        assert all(seq.state_slot is None for seq in engine.scheduler.waiting)
    assert [outputs[str(i)] for i in range(len(prompts))] == reference
    assert sum(len(r.preempted) for r in engine.trace) > 0, "nothing was preempted"


def test_engine_first_token_logprobs_match(checkpoint, hf, prompts):
    """Logits through the engine (chunked prefill carrying conv and recurrent states across
    steps) against transformers' on the whole prompt: log-probabilities within 1e-4."""
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=200, block_size=8, max_num_batched_tokens=40)
    long_prompts = [p for p in prompts if len(p) > 64]
    outs = llm.generate(long_prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    with torch.no_grad():
        for prompt, out in zip(long_prompts, outs):
            ref = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
            for tid, lp in out.outputs[0].logprobs[0].items():
                assert abs(lp.logprob - float(ref[tid])) < 1e-4


def test_state_pool_takes_and_frees_slots():
    pool = HybridCacheManager(num_blocks=8, block_size=4, num_state_slots=2)
    seqs = [Sequence([1, 2, 3], GREEDY) for _ in range(3)]
    pool.allocate(seqs[0])
    pool.allocate(seqs[1])
    assert {seqs[0].state_slot, seqs[1].state_slot} == {0, 1}
    assert not pool.can_allocate(seqs[2])  # blocks are free, slots are not
    with pytest.raises(RuntimeError, match="state slot"):
        pool.allocate(seqs[2])
    assert seqs[2].block_table == [], "a refused allocation must not take blocks"
    pool.free(seqs[0])
    assert seqs[0].state_slot is None and pool.can_allocate(seqs[2])
    pool.allocate(seqs[2])
    pool.check_invariants(seqs)
    with pytest.raises(ValueError, match="num_slots"):
        StatePool(0)
