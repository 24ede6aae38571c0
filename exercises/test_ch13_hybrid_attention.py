"""Chapter 13 — hybrid attention: one recurrent step, the conv-state update, one chunk.

Your ``gated_delta_step``, ``causal_conv1d`` and ``gated_delta_chunk``
(exercises/minivllm/ops/gated_delta.py) are graded against formulas written out here, one
head and one token at a time, on random inputs of random shapes (hypothesis): the step
against S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q; the conv against
F.conv1d with zero padding, with the state carried across pieces of any length; the chunk
against the step-by-step recurrence from the same starting state, also under a decay strong
enough that exp() of an unmasked log-decay overflows float32. Last, the engine runs a tiny
random Qwen3.5 (three Gated DeltaNet layers, one full-attention layer) on your three
functions, whose decode and prefill paths call exactly them on the CPU: a batch of prompts
prefilled in chunks over several steps beside decodes must give transformers' greedy
tokens, and log-probabilities within 1e-4 of transformers' at every generated token.

Around them, the rest of the unit: ``prepare_qk`` (grouped heads, unit-length queries and
keys, the queries scaled), ``_recurrence`` (the token loop behind
``recurrent_gated_delta_rule`` and ``gated_delta_states``, the states a verifying step keeps)
and ``chunk_gated_delta_rule`` (a sequence in chunks, the state carried from one to the next),
each against the same written-out rule, at chunk boundaries and with a last partial chunk.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from minivllm.ops.gated_delta import (causal_conv1d, chunk_gated_delta_rule, gated_delta_chunk, gated_delta_states,
                                      gated_delta_step, prepare_qk, recurrent_gated_delta_rule)
from minivllm.testing import make_tiny_checkpoint, torch_threads


def one_step(state, q, k, v, g, beta):
    """The rule for one head and one token, written out: state [dk, dv]."""
    state = torch.exp(g) * state
    delta = beta * (v - state.T @ k)
    state = state + torch.outer(k, delta)
    return state.T @ q, state


def rule_inputs(seed, length, heads, dk, dv):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1)
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, generator=gen) * 2
    beta = torch.rand(length, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 4), heads=st.integers(1, 3), dk=st.integers(1, 8),
       dv=st.integers(1, 8))
def test_ch13_gated_delta_step(seed, rows, heads, dk, dv):
    q, k, v, g, beta, _ = rule_inputs(seed, rows, heads, dk, dv)
    state = torch.randn(rows, heads, dk, dv, generator=torch.Generator().manual_seed(seed + 1))
    out, new_state = gated_delta_step(state.clone(), q, k, v, g, beta)
    assert out.shape == (rows, heads, dv), f"out must be [N, H, dv] = {(rows, heads, dv)}, got {tuple(out.shape)}"
    assert new_state.shape == state.shape, "the new state has the state's shape"
    for n in range(rows):
        for h in range(heads):
            ref_out, ref_state = one_step(state[n, h], q[n, h], k[n, h], v[n, h], g[n, h], beta[n, h])
            torch.testing.assert_close(new_state[n, h], ref_state, atol=1e-5, rtol=1e-5,
                                       msg=f"row {n}, head {h}: wrong new state")
            torch.testing.assert_close(out[n, h], ref_out, atol=1e-5, rtol=1e-5,
                                       msg=f"row {n}, head {h}: wrong output (read the *updated* state)")


def test_ch13_delta_rule_overwrites_instead_of_adding():
    """Writing v1 then v2 at the same (unit) key with beta = 1 leaves exactly v2 there."""
    k = torch.tensor([[[1.0, 0.0]]])
    state = torch.zeros(1, 1, 2, 3)
    zero, one = torch.zeros(1, 1), torch.ones(1, 1)
    _, state = gated_delta_step(state, k, k, torch.tensor([[[1.0, 2.0, 3.0]]]), zero, one)
    out, state = gated_delta_step(state, k, k, torch.tensor([[[5.0, 5.0, 5.0]]]), zero, one)
    torch.testing.assert_close(out[0, 0], torch.tensor([5.0, 5.0, 5.0]))


@given(seed=st.integers(0, 2**16), dim=st.integers(1, 6), width=st.integers(2, 5),
       pieces=st.lists(st.integers(1, 7), min_size=1, max_size=4))
def test_ch13_causal_conv1d_carries_its_state(seed, dim, width, pieces):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(pieces), dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    # The whole sequence at once, zero-padded on the left: the definition.
    ref = F.conv1d(x.T[None], weight[:, None, :], padding=width - 1, groups=dim)[0, :, : x.shape[0]].T
    state, outs, start = torch.zeros(dim, width - 1), [], 0
    for n in pieces:
        out, state = causal_conv1d(x[start : start + n], weight, state)
        assert out.shape == (n, dim), f"out must be [T, D] = {(n, dim)}, got {tuple(out.shape)}"
        assert state.shape == (dim, width - 1), f"the state must stay [D, K - 1] = {(dim, width - 1)}, got {tuple(state.shape)}"
        outs.append(out)
        start += n
        # The state is the last K - 1 inputs so far (zeros before the first token).
        seen = torch.cat([torch.zeros(width - 1, dim), x[:start]])
        torch.testing.assert_close(state, seen[-(width - 1):].T, msg=f"after {start} tokens: wrong conv state")
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-5, rtol=1e-5)


def assert_matches_recurrence(out, final, q, k, v, g, beta, state):
    """The chunk's outputs and final state against one recurrent step per token (1e-4:
    float32 both ways, summed in another order)."""
    length, heads = q.shape[:2]
    for h in range(heads):
        s = state[h]
        for t in range(length):
            o, s = one_step(s, q[t, h], k[t, h], v[t, h], g[t, h], beta[t, h])
            torch.testing.assert_close(out[t, h], o, atol=1e-4, rtol=1e-4, msg=f"token {t}, head {h}: wrong output")
        torch.testing.assert_close(final[h], s, atol=1e-4, rtol=1e-4, msg=f"head {h}: wrong final state")


@given(seed=st.integers(0, 2**16), length=st.integers(1, 24), heads=st.integers(1, 3), dk=st.integers(1, 8),
       dv=st.integers(1, 8))
def test_ch13_gated_delta_chunk_equals_the_recurrence(seed, length, heads, dk, dv):
    q, k, v, g, beta, state = rule_inputs(seed, length, heads, dk, dv)
    out, final = gated_delta_chunk(q, k, v, g, beta, state.clone())
    assert out.shape == (length, heads, dv), f"out must be [C, H, dv] = {(length, heads, dv)}, got {tuple(out.shape)}"
    assert_matches_recurrence(out, final, q, k, v, g, beta, state)


@given(seed=st.integers(0, 2**16), length=st.integers(24, 64), heads=st.integers(1, 2), dk=st.integers(1, 8),
       dv=st.integers(1, 8))
def test_ch13_gated_delta_chunk_under_strong_decay(seed, length, heads, dk, dv):
    """Real gates forget fast: g = -exp(A_log) * softplus(...) reaches -10 and below, and
    over a chunk of up to 64 tokens (the engine's) gamma_i - gamma_j exceeds 88 above the
    diagonal, where exp() overflows float32. The decay must be masked before exp (an inf
    times a zero mask is NaN), and exp(gamma_i) / exp(gamma_j) (both underflow) will not do."""
    q, k, v, _, beta, state = rule_inputs(seed, length, heads, dk, dv)
    g = -12 * torch.rand(length, heads, generator=torch.Generator().manual_seed(seed + 1))
    out, final = gated_delta_chunk(q, k, v, g, beta, state.clone())
    assert torch.isfinite(out).all() and torch.isfinite(final).all(), (
        f"inf or NaN with a strong decay over {length} tokens: mask the log-decay before exp")
    assert_matches_recurrence(out, final, q, k, v, g, beta, state)


# --- the rest of the unit -------------------------------------------------------------


def test_ch13_prepare_qk_groups_normalises_and_scales():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    k = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    qp, kp = prepare_qk(q, k, num_v_heads=6)
    assert qp.shape == (5, 6, 8) and kp.shape == (5, 6, 8), "one query and one key per value head: [T, Hv, dk]"
    assert qp.dtype == torch.float32 and kp.dtype == torch.float32, "the rule runs in float32"
    for h in range(6):
        src = h // 3
        ref_k = k[:, src].float() / (k[:, src].float().pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        torch.testing.assert_close(kp[:, h], ref_k, atol=1e-5, rtol=1e-5,
                                   msg=f"value head {h} reads key head {src} (groups of neighbours), at unit length")
        ref_q = q[:, src].float() / (q[:, src].float().pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * 8**-0.5
        torch.testing.assert_close(qp[:, h], ref_q, atol=1e-5, rtol=1e-5,
                                   msg=f"value head {h}: its query at unit length, then scaled by dk ** -0.5")


def test_ch13_prepare_qk_one_head_per_value_head():
    q, k = torch.randn(3, 4, 2), torch.randn(3, 4, 2)
    qp, kp = prepare_qk(q, k, num_v_heads=4)
    torch.testing.assert_close(kp.norm(dim=-1), torch.ones(3, 4), msg="keys at unit length (eps inside the root)")
    torch.testing.assert_close(qp.norm(dim=-1), torch.full((3, 4), 2**-0.5), msg="queries at length dk ** -0.5")


@given(seed=st.integers(0, 2**16), length=st.integers(1, 9), heads=st.integers(1, 2), dk=st.integers(1, 6),
       dv=st.integers(1, 6))
def test_ch13_recurrent_rule_and_kept_states(seed, length, heads, dk, dv):
    q, k, v, g, beta, state = rule_inputs(seed, length, heads, dk, dv)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state.clone())
    assert out.shape == (length, heads, dv), "the recurrence returns one output per token: [T, H, dv]"
    assert_matches_recurrence(out, final, q, k, v, g, beta, state)
    states = gated_delta_states(q, k, v, g, beta, state.clone())
    for h in range(heads):
        s = state[h]
        for t in range(length):
            _, s = one_step(s, q[t, h], k[t, h], v[t, h], g[t, h], beta[t, h])
            torch.testing.assert_close(states[t, h], s, atol=1e-4, rtol=1e-4,
                                       msg=f"the state kept after token {t} (head {h}) is the state *after* that token")


@pytest.mark.parametrize("length, chunk", [(1, 4), (4, 4), (5, 4), (11, 4), (12, 3), (7, 1), (20, 64)])
def test_ch13_chunked_rule_carries_the_state_across_chunks(length, chunk):
    q, k, v, g, beta, state = rule_inputs(length * 7 + chunk, length, 2, 5, 3)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state.clone(), chunk_size=chunk)
    assert out.shape == (length, 2, 3) and out.dtype == torch.float32, "outputs: float32, shaped like v"
    assert_matches_recurrence(out, final, q, k, v, g, beta, state)


# --- the whole model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    """A tiny random Qwen3.5 and transformers' own model on the same weights, float32."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5"), family="qwen3_5", seed=3)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_ch13_qwen3_5_engine_matches_transformers(tiny_qwen3_5):
    # Prompts of 1 to 150 tokens under a budget of 80 tokens a step: the long ones are
    # prefilled over several steps, each later piece continuing from the conv and recurrent
    # states left in the sequence's slot (some pieces longer than the rule's 64-token chunk),
    # beside decodes of the short ones (one recurrent step per token). Float32 on both
    # sides, the same math in another order: log-probabilities agree to ~1e-6.
    from minivllm import LLM, SamplingParams

    path, hf = tiny_qwen3_5
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 6, 70, 150)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    with torch_threads(1):
        llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8,
                  max_num_batched_tokens=80, record_trace=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        trace = llm.engine.trace
        assert any({"prefill", "decode"} <= {kind for *_, kind in r.seqs} for r in trace), (
            "the test needs a step with prefills beside decodes")
        pieces = [n for r in trace for _, n, kind in r.seqs if kind == "prefill"]
        assert len(pieces) > len(prompts) and max(pieces) > 64, (
            f"the test needs prompts prefilled over several steps, in pieces over 64 tokens: {pieces}")
        with torch.no_grad():
            for prompt, out in zip(prompts, outputs):
                tokens = out.outputs[0].token_ids
                ids = torch.tensor([prompt])
                expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                       do_sample=False)[0, len(prompt):].tolist()
                assert tokens == expected, (
                    f"{len(prompt)}-token prompt: greedy tokens {tokens}, transformers {expected}")
                ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].log_softmax(-1)
                for step, entry in enumerate(out.outputs[0].logprobs):
                    for tid, lp in entry.items():
                        assert abs(lp.logprob - float(ref[step, tid])) < 1e-4, (
                            f"{len(prompt)}-token prompt, generated token {step}: log-probability of token {tid} "
                            f"{lp.logprob:.6f}, transformers {float(ref[step, tid]):.6f}")
