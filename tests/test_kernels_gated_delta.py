"""The gated delta rule's Triton kernels against the torch reference, on fresh random inputs.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set in conftest)
at small shapes in float32: the interpreter computes in numpy float32 and every product
is a true float32 one (input_precision "ieee"), so results agree with the reference to
float32 rounding of O(1) values summed over a chunk: atol 1e-4. The same tests at a real
Qwen3.5 layer's shape in bfloat16 are in tests/test_gpu_qwen3_5.py.

Inputs are views into one packed projection, as the layer produces them; the state pool
is full of random values, so a slot that is written when it should not be (or not written
when it should) shows; padding rows (slot -1) must leave every slot untouched.
"""
import pytest
import torch

from minivllm.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule, gated_delta_step, prepare_qk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: compiled, float32, small shapes
TOL = dict(atol=1e-4, rtol=1e-4)
SHAPES = [(2, 4, 16, 16), (1, 1, 32, 24)]  # (key heads, value heads, key dim, value dim)


def packed_inputs(num_tokens, hk, hv, dk, dv, seed=0):
    """q, k, v as strided views of one [tokens, 2 * hk * dk + hv * dv] tensor, and float32 g, beta."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(num_tokens, 2 * hk * dk + hv * dv, generator=g).to(DEVICE)
    q = mixed[:, : hk * dk].view(num_tokens, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(num_tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(num_tokens, hv, dv)
    decay = -torch.rand(num_tokens, hv, generator=g) * 1.5
    beta = torch.rand(num_tokens, hv, generator=g)
    return q, k, v, decay.to(DEVICE), beta.to(DEVICE)


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
def test_recurrent_step_kernel(hk, hv, dk, dv):
    from minivllm.kernels.gated_delta import recurrent_gated_delta_step

    q, k, v, decay, beta = packed_inputs(5, hk, hv, dk, dv)
    states = torch.randn(8, hv, dk, dv, device=DEVICE)
    slots = torch.tensor([6, 0, -1, 3, 2], device=DEVICE)  # row 2 is padding
    has_initial = torch.tensor([1, 1, 1, 0, 1], device=DEVICE)  # row 3 starts from zeros
    before = states.clone()
    out = recurrent_gated_delta_step(q, k, v, decay, beta, states, slots, has_initial)
    qp, kp = prepare_qk(q, k, hv)
    for row in (0, 1, 3, 4):
        start = before[slots[row]] if has_initial[row] else torch.zeros(hv, dk, dv, device=DEVICE)
        ref_out, ref_state = gated_delta_step(start[None], qp[row : row + 1], kp[row : row + 1], v[row : row + 1],
                                              decay[row : row + 1], beta[row : row + 1])
        torch.testing.assert_close(out[row], ref_out[0], **TOL)
        torch.testing.assert_close(states[slots[row]], ref_state[0], **TOL)
    assert out[2].abs().max() == 0, "a padding row's output must be zeros"
    for slot in (1, 4, 5, 7):  # nobody's
        assert torch.equal(states[slot], before[slot])


def test_conv_update_kernel():
    from minivllm.kernels.gated_delta import causal_conv1d_update

    g = torch.Generator().manual_seed(1)
    dim, width = 40, 4
    x = torch.randn(4, dim + 8, generator=g).to(DEVICE)[:, :dim]  # a strided view
    weight = torch.randn(dim, 1, width, generator=g).to(DEVICE)[:, 0]
    states = torch.randn(5, dim, width - 1, generator=g).to(DEVICE)
    slots, has_initial = torch.tensor([3, -1, 0, 1], device=DEVICE), torch.tensor([1, 1, 0, 1], device=DEVICE)
    before = states.clone()
    out = causal_conv1d_update(x, weight, states, slots, has_initial)
    for row in (0, 2, 3):
        start = before[slots[row]] if has_initial[row] else torch.zeros(dim, width - 1, device=DEVICE)
        ref, ref_state = causal_conv1d(x[row : row + 1], weight, start)
        torch.testing.assert_close(out[row], torch.nn.functional.silu(ref[0]), **TOL)
        torch.testing.assert_close(states[slots[row]], ref_state, atol=0, rtol=0)
    assert out[1].abs().max() == 0
    for slot in (2, 4):
        assert torch.equal(states[slot], before[slot])


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
@pytest.mark.parametrize("with_pool", [True, False])
def test_chunk_kernel(hk, hv, dk, dv, with_pool):
    """Packed sequences of 1 to 130 tokens (one, two and three chunks, a chunk of one
    token), some continuing from their slot's state, some starting from zeros."""
    from minivllm.kernels.gated_delta import chunk_gated_delta_varlen

    lens = [70, 1, 64, 130, 9]
    q, k, v, decay, beta = packed_inputs(sum(lens), hk, hv, dk, dv, seed=2)
    cu = torch.tensor([0] + lens).cumsum(0).to(device=DEVICE, dtype=torch.int32)
    states = torch.randn(7, hv, dk, dv, device=DEVICE)
    slots = torch.tensor([4, 0, 6, 2, 5], device=DEVICE)
    has_initial = torch.tensor([1, 0, 1, 0, 1], device=DEVICE)
    before = states.clone()
    if with_pool:
        out = chunk_gated_delta_varlen(q, k, v, decay, beta, states, slots, has_initial, cu, max(lens))
    else:
        out = chunk_gated_delta_varlen(q, k, v, decay, beta, None, None, None, cu, max(lens))
    assert not out.isnan().any()
    qp, kp = prepare_qk(q, k, hv)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = before[slots[i]] if with_pool and has_initial[i] else torch.zeros(hv, dk, dv, device=DEVICE)
        part = slice(start, end)
        ref_out, ref_state = chunk_gated_delta_rule(qp[part], kp[part], v[part], decay[part], beta[part], init)
        torch.testing.assert_close(out[part], ref_out, **TOL)
        if with_pool:
            torch.testing.assert_close(states[slots[i]], ref_state, **TOL)
    for slot in (1, 3) if with_pool else range(7):
        assert torch.equal(states[slot], before[slot])


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
def test_record_states_kernel(hk, hv, dk, dv):
    """Speculative decoding: each verifying sequence's state after each of its first
    counts[i] tokens lands in its slot's spec entries; nothing else is written (the spec
    pool starts full of random values, the state pool must not change at all)."""
    from minivllm.kernels.gated_delta import record_gated_delta_states
    from minivllm.ops.gated_delta import gated_delta_states

    lens = [4, 30, 2, 3, 1]  # sequence 1 is a prefill chunk beside them (keeps nothing)
    counts = torch.tensor([3, 0, 1, 2, 0], device=DEVICE)
    q, k, v, decay, beta = packed_inputs(sum(lens), hk, hv, dk, dv, seed=3)
    cu = torch.tensor([0] + lens).cumsum(0).to(device=DEVICE, dtype=torch.int64)
    states = torch.randn(7, hv, dk, dv, device=DEVICE)
    spec = torch.randn(7, 3, hv, dk, dv, device=DEVICE)
    slots = torch.tensor([4, 0, 6, 2, -1], device=DEVICE)  # the last row is padding
    has_initial = torch.tensor([1, 1, 1, 0, 1], device=DEVICE)  # slot 2 starts from zeros
    before, spec_before = states.clone(), spec.clone()
    record_gated_delta_states(q, k, v, decay, beta, states, slots, has_initial, cu, counts, spec)
    assert torch.equal(states, before)
    qp, kp = prepare_qk(q, k, hv)
    written = torch.zeros(7, 3, dtype=torch.bool)
    for i, (start, n) in enumerate(zip(cu[:-1].tolist(), counts.tolist())):
        if not n:
            continue
        init = before[slots[i]] if has_initial[i] else torch.zeros(hv, dk, dv, device=DEVICE)
        part = slice(start, start + n)
        ref = gated_delta_states(qp[part], kp[part], v[part], decay[part], beta[part], init)
        torch.testing.assert_close(spec[slots[i], :n], ref, **TOL)
        written[slots[i], :n] = True
    assert torch.equal(spec[~written.to(DEVICE)], spec_before[~written.to(DEVICE)])


def test_kernels_reject_bad_shapes():
    from minivllm.kernels.gated_delta import chunk_gated_delta_varlen, recurrent_gated_delta_step

    q, k, v, decay, beta = packed_inputs(4, 2, 4, 16, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        chunk_gated_delta_varlen(q, k, v, decay.double(), beta, None, None, None, cu, 4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_varlen(q, k, v[:, :3], decay[:, :3], beta[:, :3], None, None, None, cu, 4)
    with pytest.raises(ValueError, match="states"):
        recurrent_gated_delta_step(q, k, v, decay, beta, torch.zeros(3, 4, 16, 8, device=DEVICE),
                                   torch.zeros(4, dtype=torch.long, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE))


def test_engine_with_the_kernels_matches_the_reference(tmp_path, monkeypatch):
    """The whole engine on a tiny Qwen3.5 with the kernels switched in (interpreted):
    prefill steps (chunked over several steps), mixed steps and decode steps take the
    Triton path, and the greedy tokens equal the torch reference's."""
    from minivllm import LLM, SamplingParams
    from minivllm.ops import gated_delta
    from minivllm.testing import make_tiny_checkpoint, torch_threads

    path = make_tiny_checkpoint(tmp_path, family="qwen3_5", seed=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 70, 20)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = []
    with torch_threads(1):
        for kernels in (False, True):
            monkeypatch.setattr(gated_delta, "use_triton", lambda x, on=kernels: on)
            llm = LLM(str(path), dtype="float32", device=DEVICE, num_kv_blocks=64, block_size=8, max_num_batched_tokens=32,
                      enforce_eager=True)
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]


# -- short steps (verifying steps, short prompts): the recurrence token by token ----------

SHORT_LENS = [4, 1, 3, 0, 2]  # sequence 3 has no tokens (a padded graph's empty sequence)
SHORT_SLOTS = [4, 0, 6, 2, -1]  # the last one is padding: it must write nothing at all
SHORT_INITIAL = [1, 0, 1, 1, 1]  # sequence 1 starts from zeros (a one-token prompt)
SHORT_COUNTS = [3, 0, 2, 0, 1]  # the states each keeps for a rollback


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
@pytest.mark.parametrize("keep_spec", [True, False])
def test_recurrent_short_kernel(hk, hv, dk, dv, keep_spec):
    """Each sequence's outputs and final state are decoding's, one token at a time from its
    slot's state; with counts, its state after each of its first counts[i] tokens lands in
    its spec entries. Nothing else is written: the pools start full of random values, the
    padding sequence and the empty one leave their slots as they were."""
    from minivllm.kernels.gated_delta import recurrent_gated_delta_short

    q, k, v, decay, beta = packed_inputs(sum(SHORT_LENS), hk, hv, dk, dv, seed=4)
    cu = torch.tensor([0] + SHORT_LENS).cumsum(0).to(DEVICE)
    states = torch.randn(7, hv, dk, dv, device=DEVICE)
    spec = torch.randn(7, 3, hv, dk, dv, device=DEVICE)
    slots, has_initial = torch.tensor(SHORT_SLOTS, device=DEVICE), torch.tensor(SHORT_INITIAL, device=DEVICE)
    counts = torch.tensor(SHORT_COUNTS, device=DEVICE)
    before, spec_before = states.clone(), spec.clone()
    out = recurrent_gated_delta_short(q, k, v, decay, beta, states, slots, has_initial, cu,
                                      counts if keep_spec else None, spec if keep_spec else None)
    qp, kp = prepare_qk(q, k, hv)
    written = torch.zeros(7, 3, dtype=torch.bool)
    for i, (start, n) in enumerate(zip(cu[:-1].tolist(), SHORT_LENS)):
        slot = SHORT_SLOTS[i]
        if slot < 0:
            assert out[start : start + n].abs().max() == 0, "a padding sequence's output must be zeros"
            continue
        state = before[slot] if SHORT_INITIAL[i] else torch.zeros(hv, dk, dv, device=DEVICE)
        for j in range(n):
            t = slice(start + j, start + j + 1)
            ref_out, state = gated_delta_step(state[None], qp[t], kp[t], v[t], decay[t], beta[t])
            state = state[0]
            torch.testing.assert_close(out[start + j], ref_out[0], **TOL)
            if keep_spec and j < SHORT_COUNTS[i]:
                torch.testing.assert_close(spec[slot, j], state, **TOL)
                written[slot, j] = True
        torch.testing.assert_close(states[slot], state if n else before[slot], **TOL)
    for slot in (1, 3, 5, 2):  # nobody's, and the empty sequence's
        assert torch.equal(states[slot], before[slot])
    assert torch.equal(spec[~written.to(DEVICE)], spec_before[~written.to(DEVICE)]), "a spec entry nobody kept changed"


@pytest.mark.parametrize("keep_spec", [True, False])
def test_conv_short_kernel(keep_spec):
    """The conv over a few inputs per sequence: outputs and the final window as the
    reference's from the slot's window, the window after each of the first counts[i] inputs
    kept, nothing else written (sequence 0 has more inputs than the window is wide)."""
    from minivllm.kernels.gated_delta import causal_conv1d_short

    lens = [5, *SHORT_LENS[1:]]
    g = torch.Generator().manual_seed(5)
    dim, width = 40, 4
    x = torch.randn(sum(lens), dim + 8, generator=g).to(DEVICE)[:, :dim]  # a strided view
    weight = torch.randn(dim, 1, width, generator=g).to(DEVICE)[:, 0]
    states = torch.randn(7, dim, width - 1, generator=g).to(DEVICE)
    spec = torch.randn(7, 4, dim, width - 1, generator=g).to(DEVICE)
    cu = torch.tensor([0] + lens).cumsum(0).to(DEVICE)
    slots, has_initial = torch.tensor(SHORT_SLOTS, device=DEVICE), torch.tensor(SHORT_INITIAL, device=DEVICE)
    counts = torch.tensor([4, *SHORT_COUNTS[1:]], device=DEVICE)
    before, spec_before = states.clone(), spec.clone()
    out = causal_conv1d_short(x, weight, states, slots, has_initial, cu, counts if keep_spec else None,
                              spec if keep_spec else None)
    written = torch.zeros(7, 4, dtype=torch.bool)
    for i, (start, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        slot = SHORT_SLOTS[i]
        if slot < 0:
            assert out[start : start + n].abs().max() == 0
            continue
        state = before[slot] if SHORT_INITIAL[i] else torch.zeros(dim, width - 1, device=DEVICE)
        for j in range(n):
            ref, state = causal_conv1d(x[start + j : start + j + 1], weight, state)
            torch.testing.assert_close(out[start + j], torch.nn.functional.silu(ref[0]), **TOL)
            if keep_spec and j < int(counts[i]):
                torch.testing.assert_close(spec[slot, j], state, atol=0, rtol=0)
                written[slot, j] = True
        torch.testing.assert_close(states[slot], state if n else before[slot], atol=0, rtol=0)
    for slot in (1, 3, 5, 2):
        assert torch.equal(states[slot], before[slot])
    assert torch.equal(spec[~written.to(DEVICE)], spec_before[~written.to(DEVICE)])
