"""Speculative decoding on hybrid models (chapter 19): a verifying step runs a Gated
DeltaNet layer's state over the sequence's last token and all its drafts, and when the
target rejects a draft the sequence must continue from the state after the last accepted
one. The layer keeps its state after each draft (conv window and recurrent state) and the
engine puts the right one back; here, that state is checked against decoding the same
tokens one by one, and the engine's greedy output with speculation against its output
without, token for token.

To reach every acceptance length, not only those an n-gram proposer happens to produce on
a random model, most engine tests draft with an oracle: it proposes the continuation that
decoding without speculation produced, with one draft (at a random place, or none) made
wrong. Both the torch reference and the Triton kernels (interpreted on the CPU) are run.
"""
import collections
import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context, set_context
from minivllm.engine.cuda_graphs import VERIFY
from minivllm.engine.state_pool import allocate_state_pools, keep_accepted_states
from minivllm.layers.gated_deltanet import GatedDeltaNet
from minivllm.ops import gated_delta
from minivllm.testing import make_tiny_checkpoint
from shared import OracleProposer, same_outputs

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A packed step and one-token steps round differently (the projections' matmuls, the chunked
# form against the recurrence): float32 rounding of O(1) values.
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def kernels(request, monkeypatch):
    """Run the gated delta ops on the Triton kernels (True) or the torch reference (False)."""
    monkeypatch.setattr(gated_delta, "use_triton", lambda x, on=request.param: on)
    return request.param


# -- the layer: what a verifying step keeps ----------------------------------------------

def random_layer(num_slots: int, k: int) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 16, 16, conv_kernel_size=4).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    allocate_state_pools([layer], num_slots, torch.float32, DEVICE, num_spec_states=k)
    # Every slot and spec entry full of random values: a write to the wrong place shows.
    for pool in (layer.conv_states, layer.recurrent_states, layer.spec_conv_states, layer.spec_recurrent_states):
        pool.copy_(torch.randn_like(pool) * 0.5)
    return layer


def run(layer, x, lens, slots, has_initial, counts=None):
    cu = torch.tensor([0, *lens], device=DEVICE).cumsum(0)
    dev = lambda v: torch.tensor(v, device=DEVICE)  # noqa: E731
    set_context(is_prefill=max(lens) > 1, cu_seqlens_q=cu, max_seqlen_q=max(lens), state_slots=dev(slots),
                has_initial_state=dev(has_initial), spec_state_counts=None if counts is None else dev(counts))
    try:
        with torch.no_grad():
            return layer(x)
    finally:
        reset_context()


@pytest.mark.parametrize("chunk", [9, 20], ids=["short-step", "chunked"])
@pytest.mark.parametrize("kernels", [False, True], indirect=True, ids=["torch", "triton"])
def test_verifying_step_keeps_the_state_after_each_draft(kernels, chunk):
    """One packed step: two sequences verify (3 and 1 drafts), a prefill chunk of ``chunk``
    tokens runs beside them and keeps nothing, one verifying sequence starts from zeros. Each
    kept state must be the state decoding the same tokens one at a time reaches, the slot
    must hold the state after all of them, and ``keep_accepted_states`` must put back the one
    asked for. (On the kernels, a chunk of 9 makes it a short step, run token by token; one
    of 20 runs the chunked kernel beside the record kernel.)"""
    k = 3
    layer = random_layer(num_slots=6, k=k)
    lens, slots, has_initial, counts = [4, chunk, 2], [4, 1, 2], [1, 1, 0], [3, 0, 1]
    x = torch.randn(sum(lens), 32, device=DEVICE)
    pools = [p.clone() for p in (layer.conv_states, layer.recurrent_states)]
    spec_before = [p.clone() for p in (layer.spec_conv_states, layer.spec_recurrent_states)]
    out = run(layer, x, lens, slots, has_initial, counts)
    after_step = [p.clone() for p in (layer.conv_states, layer.recurrent_states)]
    kept = [p.clone() for p in (layer.spec_conv_states, layer.spec_recurrent_states)]

    # The reference: each sequence decoded one token at a time from the same states.
    layer.conv_states.copy_(pools[0])
    layer.recurrent_states.copy_(pools[1])
    starts = [0, 4, 4 + chunk]
    written = torch.zeros(6, k, dtype=torch.bool)
    for i, (start, n, slot) in enumerate(zip(starts, lens, slots)):
        for j in range(n):
            o = run(layer, x[start + j : start + j + 1], [1], [slot], [int(has_initial[i] or j > 0)])
            torch.testing.assert_close(out[start + j], o[0], **TOL)
            if j < counts[i]:
                torch.testing.assert_close(kept[0][slot, j], layer.conv_states[slot], **TOL)
                torch.testing.assert_close(kept[1][slot, j], layer.recurrent_states[slot], **TOL)
                written[slot, j] = True
        torch.testing.assert_close(after_step[0][slot], layer.conv_states[slot], **TOL)
        torch.testing.assert_close(after_step[1][slot], layer.recurrent_states[slot], **TOL)
    for now, before in zip(kept, spec_before):
        assert torch.equal(now[~written.to(DEVICE)], before[~written.to(DEVICE)]), "a spec entry nobody kept changed"
    for slot in (0, 3, 5):
        assert torch.equal(after_step[0][slot], pools[0][slot]) and torch.equal(after_step[1][slot], pools[1][slot])

    # Rejections: sequence 0 accepted 1 of its 3 drafts, sequence 2 none of its 1.
    layer.conv_states.copy_(after_step[0])
    layer.recurrent_states.copy_(after_step[1])
    keep_accepted_states([layer], torch.tensor([4, 2], device=DEVICE), torch.tensor([1, 0], device=DEVICE))
    assert torch.equal(layer.conv_states[4], kept[0][4, 1]) and torch.equal(layer.recurrent_states[4], kept[1][4, 1])
    assert torch.equal(layer.conv_states[2], kept[0][2, 0]) and torch.equal(layer.recurrent_states[2], kept[1][2, 0])
    assert torch.equal(layer.recurrent_states[1], after_step[1][1])  # the others keep theirs


# -- the engine ------------------------------------------------------------------------------

def workload(seed: int, n: int = 10):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 40), ignore_eos=True,
                             logprobs=2 if i % 3 == 0 else None) for i in range(n)]
    return prompts, params


def with_oracle(checkpoint, prompts, params, k, engine_args, before_spec=lambda: None):
    """Outputs without speculation, and with the oracle drafting up to k tokens (after
    calling ``before_spec``); the speculating engine."""
    plain = LLM(str(checkpoint), dtype="float32", device=DEVICE, **engine_args)
    want = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()  # its KV pool back before the speculating engine sizes its own
    before_spec()
    spec = LLM(str(checkpoint), dtype="float32", device=DEVICE, **engine_args,
               speculative_config=dict(NGRAM, num_speculative_tokens=k))
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)}
    spec.engine.proposer = OracleProposer(reference, spec.engine.runner.model_config.vocab_size, seed=k)
    got = spec.generate(prompts, params, use_tqdm=False)
    return want, got, spec


def assert_all_given_back(llm) -> None:
    manager = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.states.num_free_slots == manager.states.num_slots


ENGINES = {
    "roomy": dict(num_kv_blocks=256, block_size=8),
    # chunked prefill, preemption (a hybrid sequence is recomputed from zeros), small steps
    "tight": dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=24, max_num_seqs=6),
}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_with_every_acceptance_length(hybrid_checkpoint, engine, k):
    prompts, params = workload(k)
    want, got, spec = with_oracle(hybrid_checkpoint("qwen3_5"), prompts, params, k, ENGINES[engine] | {
        "record_trace": True})
    same_outputs(want, got)
    lengths = spec.engine.proposer.lengths
    assert set(lengths) == set(range(k + 1)), f"acceptance lengths seen: {dict(lengths)}"
    stats = spec.engine.stats
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    if engine == "tight":
        assert any(r.preempted for r in spec.engine.trace), "the tight pool never preempted"
    else:  # nothing cut the drafts: the engine accepted exactly what the oracle meant it to
        assert stats["spec_accepted_tokens"] == sum(a * n for a, n in lengths.items())
    assert_all_given_back(spec)


KERNELS = ("record_gated_delta_states", "chunk_gated_delta_varlen", "recurrent_gated_delta_step",
           "recurrent_gated_delta_short", "causal_conv1d_short", "causal_conv1d_update")


def test_greedy_identical_on_the_kernels(tmp_path, monkeypatch):
    """The same with the Triton kernels switched in (interpreted on the CPU) for the
    speculating engine: verifying steps run the short-step kernels, which keep their states
    as they go, prompt chunks longer than SHORT_STEP_TOKENS the chunked kernel, decode steps
    the recurrent and conv-update kernels. (The record kernel, for a verifying sequence
    beside a long chunk, is held to decoding by test_verifying_step_keeps_the_state_after_
    each_draft; the reference runs on the torch ops, which tests/test_kernels_gated_delta.py
    holds the kernels to.)"""
    from minivllm.kernels import gated_delta as kernels

    calls = collections.Counter()

    def counted(name):
        launch = getattr(kernels, name)

        def wrapper(*args):
            calls[name] += 1
            return launch(*args)
        return wrapper

    def switch_in():
        monkeypatch.setattr(gated_delta, "use_triton", lambda x: True)
        for name in KERNELS:
            monkeypatch.setattr(kernels, name, counted(name))

    path = make_tiny_checkpoint(tmp_path, family="qwen3_5", seed=4)
    prompts = workload(seed=5, n=3)[0]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)] * 3
    want, got, spec = with_oracle(path, prompts, params, 3, dict(num_kv_blocks=64, block_size=8,
                                                                 max_num_batched_tokens=32, enforce_eager=True),
                                  before_spec=switch_in)
    same_outputs(want, got)
    assert set(spec.engine.proposer.lengths) == {0, 1, 2, 3}
    assert set(calls) == set(KERNELS) - {"record_gated_delta_states"}, dict(calls)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_ngram_on_hybrid_models(hybrid_checkpoint, family):
    """The n-gram proposer on repetitive prompts: the same greedy output as without."""
    rng = random.Random(1)
    prompts = []
    for _ in range(8):
        unit = [rng.randrange(3, 500) for _ in range(rng.randint(1, 5))]
        prompts.append((unit * 20)[: rng.randint(4, 40)])
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    checkpoint = hybrid_checkpoint(family)
    want = LLM(str(checkpoint), dtype="float32", num_kv_blocks=128, block_size=8).generate(prompts, params,
                                                                                       use_tqdm=False)
    spec = LLM(str(checkpoint), dtype="float32", num_kv_blocks=128, block_size=8, speculative_config=NGRAM)
    same_outputs(want, spec.generate(prompts, params, use_tqdm=False))
    stats = spec.engine.stats
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert_all_given_back(spec)


def test_draft_model_for_a_hybrid_target(hybrid_checkpoint, tiny_qwen3):
    """A draft model with attention layers only (here an unrelated one of the same
    vocabulary: it is mostly wrong) drafts for a hybrid target: the same greedy output."""
    prompts, params = workload(seed=3, n=4)
    checkpoint = hybrid_checkpoint("qwen3_5")
    want = LLM(str(checkpoint), num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    spec = LLM(str(checkpoint), num_kv_blocks=128, speculative_config={"model": str(tiny_qwen3),
                                                                       "num_speculative_tokens": 2})
    same_outputs(want, spec.generate(prompts, params, use_tqdm=False))
    assert spec.engine.stats["spec_draft_tokens"] > 0
    assert_all_given_back(spec)


# -- on a GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
def test_record_kernel_at_qwen3_5_shape():
    """The record kernel at a real Gated DeltaNet layer's shape, bfloat16 inputs, against
    the recurrence in float32 (tolerances as tests/test_gpu_qwen3_5.py's)."""
    from minivllm.kernels.gated_delta import record_gated_delta_states
    from minivllm.ops.gated_delta import gated_delta_states, prepare_qk

    hk, hv, dk, dv, k = 16, 32, 128, 128, 4
    lens, counts = [5, 300, 2, 5], [4, 0, 1, 3]
    g = torch.Generator(device="cuda").manual_seed(0)
    mixed = torch.randn(sum(lens), 2 * hk * dk + hv * dv, device="cuda", dtype=torch.bfloat16, generator=g)
    q = mixed[:, : hk * dk].view(-1, hk, dk)
    kk = mixed[:, hk * dk : 2 * hk * dk].view(-1, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(-1, hv, dv)
    decay = -torch.rand(sum(lens), hv, device="cuda", generator=g) * 0.5
    beta = torch.rand(sum(lens), hv, device="cuda", generator=g)
    states = torch.randn(8, hv, dk, dv, device="cuda") * 0.1
    spec = torch.full((8, k, hv, dk, dv), float("nan"), device="cuda")
    slots, has_initial = torch.tensor([5, 0, 7, 2], device="cuda"), torch.tensor([1, 1, 1, 1], device="cuda")
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
    record_gated_delta_states(q, kk, v, decay, beta, states, slots, has_initial, cu,
                              torch.tensor(counts, device="cuda"), spec)
    qp, kp = prepare_qk(q, kk, hv)
    for i, (start, n) in enumerate(zip(cu[:-1].tolist(), counts)):
        if n:
            part = slice(start, start + n)
            ref = gated_delta_states(qp[part], kp[part], v[part], decay[part], beta[part], states[slots[i]])
            torch.testing.assert_close(spec[slots[i], :n], ref, atol=2e-2, rtol=2e-2)
            assert spec[slots[i], n:].isnan().all()


@pytest.mark.gpu
def test_short_step_kernels_at_qwen3_5_shape():
    """The short-step kernels at a real Gated DeltaNet layer's shape, bfloat16 inputs, a
    padded verify graph's layout (an empty sequence, a padding one): outputs, final states
    and kept states against the recurrence in float32, and nothing written for the padding
    sequence (the pools start as NaN where nothing may be read, random where it may)."""
    from minivllm.kernels.gated_delta import causal_conv1d_short, recurrent_gated_delta_short
    from minivllm.ops.gated_delta import causal_conv1d, gated_delta_step, prepare_qk

    hk, hv, dk, dv, k, width = 16, 32, 128, 128, 4, 4
    lens, counts, slots = [5, 1, 3, 0, 5], [4, 0, 2, 0, 4], [5, 0, 7, 2, -1]
    g = torch.Generator(device="cuda").manual_seed(1)
    dim = 2 * hk * dk + hv * dv
    mixed = torch.randn(sum(lens), dim, device="cuda", dtype=torch.bfloat16, generator=g)
    q, kk, v = (mixed[:, : hk * dk].view(-1, hk, dk), mixed[:, hk * dk : 2 * hk * dk].view(-1, hk, dk),
                mixed[:, 2 * hk * dk :].view(-1, hv, dv))
    decay = -torch.rand(sum(lens), hv, device="cuda", generator=g) * 0.5
    beta = torch.rand(sum(lens), hv, device="cuda", generator=g)
    weight = torch.randn(dim, width, device="cuda", dtype=torch.bfloat16, generator=g) * 0.3
    states = torch.randn(8, hv, dk, dv, device="cuda", generator=g) * 0.1
    conv = torch.randn(8, dim, width - 1, device="cuda", dtype=torch.bfloat16, generator=g)
    spec = torch.full((8, k, hv, dk, dv), float("nan"), device="cuda")
    spec_conv = torch.full((8, k, dim, width - 1), float("nan"), device="cuda", dtype=torch.bfloat16)
    before, conv_before = states.clone(), conv.clone()
    dev = lambda x: torch.tensor(x, device="cuda")  # noqa: E731
    cu, has_initial = dev([0, *lens]).cumsum(0), dev([1, 0, 1, 1, 1])
    conv_out = causal_conv1d_short(mixed, weight, conv, dev(slots), has_initial, cu, dev(counts), spec_conv)
    out = recurrent_gated_delta_short(q, kk, v, decay, beta, states, dev(slots), has_initial, cu, dev(counts), spec)
    qp, kp = prepare_qk(q, kk, hv)
    for i, (start, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        slot = slots[i]
        if slot < 0:
            assert out[start : start + n].abs().max() == 0 and conv_out[start : start + n].abs().max() == 0
            continue
        state = before[slot] if has_initial[i] else torch.zeros_like(before[slot])
        window = conv_before[slot].float() if has_initial[i] else torch.zeros_like(conv_before[slot], dtype=torch.float32)
        for j in range(n):
            t = slice(start + j, start + j + 1)
            ref_out, state = gated_delta_step(state[None], qp[t], kp[t], v[t].float(), decay[t], beta[t])
            state = state[0]
            ref_conv, window = causal_conv1d(mixed[t].float(), weight.float(), window)
            torch.testing.assert_close(out[start + j].float(), ref_out[0], atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(conv_out[start + j].float(), torch.nn.functional.silu(ref_conv[0]),
                                       atol=5e-2, rtol=2e-2)
            if j < counts[i]:
                torch.testing.assert_close(spec[slot, j], state, atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(spec_conv[slot, j].float(), window)
        torch.testing.assert_close(states[slot], state if n else before[slot], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(conv[slot].float(), window if n else conv_before[slot].float())
        assert spec[slot, counts[i]:].isnan().all() and spec_conv[slot, counts[i]:].isnan().all()
    for slot in (1, 2, 3, 4, 6):  # nobody's, the empty sequence's
        assert torch.equal(states[slot], before[slot]) and torch.equal(conv[slot], conv_before[slot])
    assert spec[[1, 2, 3, 4, 6]].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_identical_on_gpu(tmp_path, family):
    """On a GPU, float32: decode steps replay CUDA graphs (the recurrent and conv-update
    kernels), verifying steps replay verify graphs (the short-step kernels, which keep the
    states as they go), batches of several sequences among them; every acceptance length
    occurs, and the outputs are those of speculation off, token for token."""
    path = make_tiny_checkpoint(tmp_path, family=family, seed=6, hidden_size=256, num_attention_heads=8,
                                num_key_value_heads=2, head_dim=32, linear_key_head_dim=64, linear_value_head_dim=64)
    prompts, params = workload(seed=7, n=24)
    want, got, spec = with_oracle(path, prompts, params, 4, dict(gpu_memory_utilization=0.3, async_scheduling=False))
    same_outputs(want, got, logprob_tol=1e-3)
    assert set(spec.engine.proposer.lengths) == set(range(5))
    runner = spec.engine.runner
    assert runner.graphs, "decode steps did not run on CUDA graphs"
    verify = runner.cudagraphs.replays_of(VERIFY)
    assert sum(n for bs, n in verify.items() if bs > 1) > 0, "no batched verify graph replayed"


def test_state_pools_that_do_not_fit_are_a_clear_error(tmp_path):
    """The pools' size is what allocate_state_pools allocates; more than the free memory is a
    ValueError naming the settings to lower, before anything is allocated."""
    from minivllm.engine.state_pool import check_state_pools_fit, state_slot_bytes
    from minivllm.layers.gated_deltanet import state_layers
    from minivllm.loader import load_model

    path = make_tiny_checkpoint(tmp_path, family="qwen3_5", seed=6)
    layers = state_layers(load_model(str(path), dtype=torch.float32, device="cpu"))
    for k in (0, 3):
        assert state_slot_bytes(layers, torch.float32, k) == allocate_state_pools(layers, 2, torch.float32, "cpu", k)
    slot = state_slot_bytes(layers, torch.float32, 3)
    check_state_pools_fit(slot, 8, free_bytes=8 * slot, num_spec_states=3)  # exactly fits
    with pytest.raises(ValueError, match=r"max_num_seqs=8 .*num_speculative_tokens=3.*lower max_num_seqs or "
                                         r"num_speculative_tokens"):
        check_state_pools_fit(slot, 8, free_bytes=8 * slot - 1, num_spec_states=3)
    with pytest.raises(ValueError, match=r"lower max_num_seqs$"):
        check_state_pools_fit(slot, 8, free_bytes=0)
