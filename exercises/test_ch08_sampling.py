"""Chapter 08 — sampling: the top-p filter and the Gumbel-max draw.

Your ``top_p_mask`` (exercises/minivllm/layers/sampler.py) is checked by hand on small
distributions (the token that crosses p stays; at least one token always stays; p = 1
keeps everything), against float64 arithmetic and against transformers'
``TopPLogitsWarper`` on random logits in random order, row by row with different p, and
after a top-k cut. Kept logits must come back unchanged, dropped ones as -inf. Your
``gumbel_max_sample`` must return the exact argmax of probs / noise for given noise, and
many draws must reproduce the probabilities; then the engine's seeded sampling must be
reproducible whatever else is in the batch. Your ``repetition_penalty``
(exercises/minivllm/layers/penalties.py) is checked by hand, against a loop over random
logits with a different penalty per row (above and below 1), and through the sampler, where
a token seen only in the prompt must be penalised as much as one the request generated.

Also graded: ``top_k_mask``, ``min_p_mask`` and ``Sampler._draw_filtered`` (each filter's
effect on many draws, the temperature first, greedy and seeded rows, a tiny top-p).
"""
import math

import pytest
import torch
from hypothesis import assume
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TopPLogitsWarper

from minivllm.layers.logits_processors import TokenHistory
from minivllm.layers.penalties import repetition_penalty
from minivllm.layers.sampler import Sampler, gumbel_max_sample, top_k_mask, top_p_mask
from minivllm.sampling_params import SamplingParams
from minivllm.testing import torch_threads

NEG_INF = float("-inf")


def kept(masked: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(masked.tolist()) if x != NEG_INF}


def logits_of(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def reference_nucleus(row: torch.Tensor, p: float) -> tuple[set[int], float]:
    """The kept set in float64, and how close the decision came to p (to skip ties)."""
    probs = row.double().softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs
    keep = before < p
    finite = sorted_probs > 0
    margin = (before[finite] - p).abs().min().item() if bool(finite.any()) else 1.0
    return {int(i) for i in order[keep & finite]}, margin


def check_mask(logits: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> None:
    assert isinstance(out, torch.Tensor) and out.shape == logits.shape, (
        f"top_p_mask must return logits of shape {tuple(logits.shape)}, got {getattr(out, 'shape', type(out))}"
    )
    assert out.dtype == logits.dtype, f"top_p_mask must keep the dtype {logits.dtype}, got {out.dtype}"
    finite = out != NEG_INF
    assert torch.equal(out[finite], logits[finite]), "kept logits must come back unchanged (no softmax, no rescaling)"
    assert bool(finite.any(dim=-1).all()), "top_p_mask dropped every token of a row: the most likely one always stays"


# --- top-p ----------------------------------------------------------------------------


def test_ch08_top_p_keeps_the_token_that_crosses_p():
    logits = logits_of([[0.5, 0.3, 0.15, 0.05]])
    for p, expected in [(0.75, {0, 1}), (0.4, {0}), (0.9, {0, 1, 2}), (0.96, {0, 1, 2, 3})]:
        out = top_p_mask(logits, torch.tensor([p]))
        check_mask(logits, torch.tensor([p]), out)
        assert kept(out[0]) == expected, (
            f"probabilities [0.5, 0.3, 0.15, 0.05], p={p}: keep {sorted(expected)} (the smallest set of most likely "
            f"tokens whose probabilities reach p, including the token that crosses p), kept {sorted(kept(out[0]))}"
        )


def test_ch08_top_p_stops_when_the_mass_reaches_p_exactly():
    # Eight equally likely tokens: probabilities, cumulative sums and p are exact in
    # binary, so "reaches p" is tested exactly: k / 8 of the mass needs exactly k tokens.
    logits = torch.zeros(1, 8)
    for k in range(1, 9):
        out = top_p_mask(logits, torch.tensor([k / 8]))
        check_mask(logits, torch.tensor([k / 8]), out)
        assert len(kept(out[0])) == k, (
            f"8 tokens of probability 1/8, p = {k}/8: the smallest set reaching p has {k} tokens, kept {len(kept(out[0]))}"
        )


def test_ch08_top_p_in_vocabulary_order():
    # The same distribution shuffled: the mask must land on the right tokens, not on
    # positions of the sorted order.
    probs = [0.05, 0.3, 0.15, 0.5]
    out = top_p_mask(logits_of([probs]), torch.tensor([0.75]))
    assert kept(out[0]) == {1, 3}, f"probabilities {probs}, p=0.75: keep tokens 1 and 3, kept {sorted(kept(out[0]))}"


def test_ch08_top_p_extremes():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    out = top_p_mask(logits, torch.tensor([1.0, 1e-6, 1.0]))
    assert kept(out[0]) == set(range(50)) and kept(out[2]) == set(range(50)), "p = 1 keeps every token"
    assert kept(out[1]) == {int(logits[1].argmax())}, "a tiny p keeps exactly the most likely token"


def test_ch08_top_p_each_row_its_own_p():
    base = [0.5, 0.3, 0.15, 0.05]
    logits = logits_of([base, base[::-1], base, base[::-1]])
    out = top_p_mask(logits, torch.tensor([0.75, 0.75, 0.4, 0.96]))
    assert [kept(r) for r in out] == [{0, 1}, {3, 2}, {0}, {0, 1, 2, 3}], (
        f"rows with p = 0.75, 0.75, 0.4, 0.96 kept {[sorted(kept(r)) for r in out]}"
    )


@settings(max_examples=60)
@given(
    batch=st.integers(1, 4),
    vocab=st.integers(2, 300),
    scale=st.sampled_from([0.5, 2.0, 6.0]),
    ps=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
    seed=st.integers(0, 2**31),
)
def test_ch08_top_p_matches_float64_and_transformers(batch, vocab, scale, ps, seed):
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    p = torch.tensor(ps[:batch])
    expected, margins = zip(*(reference_nucleus(logits[i], float(p[i])) for i in range(batch)))
    assume(min(margins) > 1e-5)  # a decision within rounding of p may go either way
    out = top_p_mask(logits, p)
    check_mask(logits, p, out)
    for i in range(batch):
        assert kept(out[i]) == expected[i], f"row {i}, p={float(p[i]):.4f}: kept {sorted(kept(out[i]))}, expected {sorted(expected[i])}"
        hf = TopPLogitsWarper(float(p[i]))(None, logits[i : i + 1].clone())[0]
        assert kept(out[i]) == kept(hf), f"row {i}: differs from transformers' TopPLogitsWarper"


def test_ch08_top_p_after_top_k():
    # In the sampler, top-p runs on logits that top-k has already cut: -inf entries have
    # probability 0 and must stay dropped.
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(3)) * 2
    cut = top_k_mask(logits, torch.tensor([6, 3]))
    out = top_p_mask(cut, torch.tensor([0.9, 0.5]))
    for i in range(2):
        expected, _ = reference_nucleus(cut[i], float([0.9, 0.5][i]))
        assert kept(out[i]) == expected and kept(out[i]) <= kept(cut[i])


# --- the Gumbel-max draw --------------------------------------------------------------


@settings(max_examples=40)
@given(batch=st.integers(1, 6), vocab=st.integers(2, 200), seed=st.integers(0, 2**31))
def test_ch08_gumbel_max_sample_is_the_argmax_of_probs_over_noise(batch, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(batch, vocab, generator=g) ** 3
    probs[:, : vocab // 3] = 0  # some tokens filtered out
    probs[:, -1] += 1e-3
    probs = probs / probs.sum(-1, keepdim=True)
    noise = torch.empty(batch, vocab).exponential_(generator=g)
    out = gumbel_max_sample(probs, noise)
    assert isinstance(out, torch.Tensor) and out.shape == (batch,), (
        f"gumbel_max_sample must return one token id per row, shape ({batch},), got {getattr(out, 'shape', type(out))}"
    )
    assert not out.dtype.is_floating_point, f"token ids are integers, got {out.dtype}"
    expected = (probs / noise).argmax(-1)
    assert torch.equal(out, expected), f"for the given noise the draw is argmax(probs / noise) = {expected.tolist()}, got {out.tolist()}"


def test_ch08_gumbel_max_sample_draws_from_probs():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    n = 60_000
    noise = torch.empty(n, 6).exponential_(generator=torch.Generator().manual_seed(0))
    draws = gumbel_max_sample(probs.expand(n, -1), noise)
    freq = torch.bincount(draws, minlength=6).double() / n
    assert freq[5] == 0, "a token of probability 0 was drawn"
    # 60,000 draws: the standard error of a frequency is at most 0.002; allow 4 of them.
    assert (freq[:5] - probs[:5].double()).abs().max() < 0.008, (
        f"frequencies {[round(f, 4) for f in freq.tolist()]} do not match probabilities {probs.tolist()}"
    )


def test_ch08_sampler_distribution_with_temperature_and_filters():
    # The whole Sampler: temperature 0.7 then top-k 4, through your draw. The draw must
    # follow softmax(logits / 0.7) restricted to the 4 most likely tokens.
    logits = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -1.0, -3.0])
    expected = torch.zeros(8, dtype=torch.float64)
    expected[:4] = (logits[:4].double() / 0.7).softmax(-1)
    n = 20_000
    torch.manual_seed(1)
    params = [SamplingParams(temperature=0.7, top_k=4)] * n
    out = Sampler()(logits.expand(n, -1).clone(), params, [None] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=8).double() / n
    assert (freq - expected).abs().max() < 0.015, f"frequencies {freq.tolist()}, expected {expected.tolist()}"


def test_ch08_seeded_requests_are_reproducible_in_any_batch(tiny_qwen3):
    from minivllm import LLM

    with torch_threads(1):
        llm = LLM(model=tiny_qwen3, dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)
        prompt = [5, 17, 301, 42, 7, 99]
        seeded = SamplingParams(temperature=1.3, top_p=0.95, seed=2024, max_tokens=16, ignore_eos=True)
        [alone] = llm.generate([prompt], seeded, use_tqdm=False)
        others = [[1, 2, 3], [400, 401, 402, 403, 404], [9] * 11]
        noisy = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
        crowd = llm.generate([others[0], prompt, *others[1:]], [noisy, seeded, noisy, noisy], use_tqdm=False)
        [other_seed] = llm.generate(
            [prompt], SamplingParams(temperature=1.3, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True), use_tqdm=False)
        [greedy] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    a, b = alone.outputs[0].token_ids, crowd[1].outputs[0].token_ids
    assert a == b, f"the same seed gave {a} alone and {b} in a batch"
    assert a != other_seed.outputs[0].token_ids, "two different seeds gave the same 16 tokens: is the noise used?"
    assert a != greedy.outputs[0].token_ids, "sampling at temperature 1.3 gave exactly the greedy tokens: is the noise used?"


def test_ch08_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 0.0, 4.0]])
    seen = torch.tensor([[True, True, False, True, True, False]])
    out = repetition_penalty(logits, seen, torch.tensor([2.0]))
    # Seen: 2 / 2, -1 * 2, -3 * 2, 0 stays 0; not seen: unchanged. Dividing a negative logit
    # would raise it (make the token *more* likely): negative logits are multiplied.
    assert out.tolist() == [[1.0, -2.0, 0.5, -6.0, 0.0, 4.0]]


@pytest.mark.parametrize("seed", range(4))
def test_ch08_repetition_penalty_matches_a_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 5, 40
    logits = torch.randn(rows, vocab, generator=gen) * 3
    seen = torch.rand(rows, vocab, generator=gen) < 0.4
    penalty = torch.tensor([1.3, 0.6, 1.0, 2.5, 0.9])  # each row its own; below 1 rewards repeats
    out = repetition_penalty(logits.clone(), seen, penalty)
    assert out.shape == logits.shape
    for r in range(rows):
        for t in range(vocab):
            x = logits[r, t].item()
            want = (x / penalty[r].item() if x > 0 else x * penalty[r].item()) if seen[r, t] else x
            assert out[r, t].item() == pytest.approx(want, rel=1e-6, abs=1e-6), (r, t, x)


def test_ch08_repetition_penalty_covers_the_prompt():
    # Through the sampler: token 3 only in the prompt, token 5 only in the output; both are
    # the row's strongest logits, both must be penalised, and greedy then picks token 7.
    logits = torch.full((1, 10), -1.0)
    logits[0, 3], logits[0, 5], logits[0, 7] = 3.0, 2.9, 1.0
    history = TokenHistory([[3, 3]], [[5]], [-1], None, [[]])
    params = [SamplingParams(temperature=0, repetition_penalty=4.0)]
    out = Sampler()(logits.clone(), params, [None], history=history)
    assert out.token_ids == [7], "a token seen in the prompt (or the output) must have its logit penalised"
    # A penalty below 1 rewards the tokens seen: the prompt's 3 stays first.
    rewarded = Sampler()(logits.clone(), [SamplingParams(temperature=0, repetition_penalty=0.5)], [None],
                         history=history)
    assert rewarded.token_ids == [3]


# --- top-k and min-p ------------------------------------------------------------------

from minivllm.layers.sampler import min_p_mask  # noqa: E402


@pytest.mark.parametrize("k, expected", [(1, {0}), (2, {0, 3}), (3, {0, 3, 4}), (5, {0, 1, 2, 3, 4}),
                                         (0, {0, 1, 2, 3, 4}), (-1, {0, 1, 2, 3, 4}), (9, {0, 1, 2, 3, 4})])
def test_ch08_top_k_keeps_the_k_largest(k, expected):
    logits = torch.tensor([[3.0, -1.0, -2.0, 2.0, 1.0]])
    out = top_k_mask(logits, torch.tensor([k]))
    assert kept(out[0]) == expected, (
        f"top-k {k} of {logits[0].tolist()} keeps {sorted(expected)} (0 or less: all; past the vocabulary: all), "
        f"kept {sorted(kept(out[0]))}")
    assert torch.equal(out[0, list(expected)], logits[0, list(expected)]), "kept logits come back unchanged"


def test_ch08_top_k_keeps_ties_and_works_row_by_row():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [4.0, 3.0, 2.0, 1.0]])
    out = top_k_mask(logits, torch.tensor([1, 3]))
    assert kept(out[0]) == {1, 2}, "ties at the k-th value are kept"
    assert kept(out[1]) == {0, 1, 2}, "each row has its own k"


@pytest.mark.parametrize("min_p, expected", [(0.0, {0, 1, 2, 3}), (0.35, {0, 1}), (0.5, {0, 1}), (0.51, {0}),
                                             (1.0, {0})])
def test_ch08_min_p_keeps_tokens_near_the_top(min_p, expected):
    probs = [0.5, 0.25, 0.15, 0.1]
    logits = logits_of(probs)[None]
    out = min_p_mask(logits, torch.tensor([min_p]))
    assert kept(out[0]) == expected, (
        f"min-p {min_p}: keep the tokens whose probability is at least {min_p} x the top one's (0.5) of {probs}: "
        f"{sorted(expected)}, kept {sorted(kept(out[0]))}")
    assert torch.equal(out[0, list(expected)], logits[0, list(expected)]), "kept logits come back unchanged"


def test_ch08_min_p_row_by_row():
    logits = logits_of([0.4, 0.3, 0.2, 0.1]).expand(2, -1).clone()
    out = min_p_mask(logits, torch.tensor([0.6, 0.2]))
    assert kept(out[0]) == {0, 1} and kept(out[1]) == {0, 1, 2, 3}, "each row has its own min_p"


# --- the filtered draw ------------------------------------------------------------------


def draw(logits_row, params_list, seed=0):
    n = len(params_list)
    torch.manual_seed(seed)
    logits = logits_row.expand(n, -1).clone()
    return Sampler()(logits, params_list, [None] * n).token_ids


def frequencies(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize("name, params, allowed", [
    ("top_p", SamplingParams(temperature=1.0, top_p=0.6), lambda p: p.cumsum(-1) - p < 0.6),
    ("min_p", SamplingParams(temperature=1.0, min_p=0.3), lambda p: p >= 0.3 * p.max()),
    ("top_k", SamplingParams(temperature=1.0, top_k=2), lambda p: torch.arange(len(p)) < 2),
])
def test_ch08_each_filter_restricts_the_draw(name, params, allowed):
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04], dtype=torch.float64)
    n = 20_000
    tokens = draw(probs.log().float(), [params] * n, seed=3)
    keep = allowed(probs)
    expected = torch.where(keep, probs, 0.0)
    expected /= expected.sum()
    freq = frequencies(tokens, 6)
    assert (freq - expected).abs().max() < 0.015, (
        f"{name}: the draw follows the filtered, renormalised distribution {expected.tolist()}, got {freq.tolist()}")


def test_ch08_temperature_before_the_filters():
    # At temperature 0.5 the top token has ~0.55 of the mass: top-p 0.5 keeps it alone.
    # Filtering before the temperature would keep two tokens (0.45 < 0.5 at temperature 1).
    probs = torch.tensor([0.45, 0.35, 0.2], dtype=torch.float64)
    tokens = draw(probs.log().float(), [SamplingParams(temperature=0.5, top_p=0.5)] * 2000, seed=4)
    assert set(tokens) == {0}, f"the temperature scales the logits first, then top-p filters: drew {set(tokens)}"


def test_ch08_greedy_rows_beside_sampled_ones():
    probs = torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 500
    tokens = draw(probs.log().float(), params, seed=5)
    assert set(tokens[0::2]) == {1}, "a greedy row keeps its argmax"
    assert set(tokens[1::2]) == {0, 1, 2}, "a sampled row draws"


def test_ch08_a_seeded_row_draws_from_its_own_generator():
    logits = torch.zeros(1, 50)
    params = [SamplingParams(temperature=1.0, seed=1)]
    tokens = []
    for other in range(4):
        torch.manual_seed(other)  # the global generator differs each time
        gen = torch.Generator().manual_seed(1234)
        tokens.append(Sampler()(logits.clone(), params, [gen]).token_ids[0])
    assert len(set(tokens)) == 1, f"a seeded row's noise comes from its own generator, not the global one: {tokens}"


def test_ch08_a_tiny_top_p_keeps_the_top_token():
    probs = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    tokens = draw(probs.log().float(), [SamplingParams(temperature=1.0, top_p=1e-50)] * 200, seed=6)
    assert set(tokens) == {1}, f"a p too small for float32 still keeps the most likely token: drew {set(tokens)}"
