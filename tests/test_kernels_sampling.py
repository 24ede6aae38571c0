"""The one-pass sampler (kernels.sampling.gumbel_argmax) against what it must compute.

A draw cannot be compared with a reference draw for draw (the kernel's noise is Philox in
registers), so: greedy rows must equal torch.argmax exactly, ties included (the first
maximum); a seed must draw the same token wherever its row sits; and the draws must follow
softmax(x / T), checked with a chi-square test. On the CPU the kernel runs in Triton's
interpreter (set in conftest), on the GPU at Qwen3's vocabulary.
"""
import pytest
import torch

from minivllm.kernels.sampling import gumbel_argmax
from minivllm.ops.sampling import gumbel_argmax_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
VOCAB = 151936 if CUDA else 300


def test_greedy_rows_are_torch_argmax_with_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, VOCAB, generator=g).to(DEVICE, torch.bfloat16)
    logits[3, 5] = logits[3, VOCAB - 7] = logits[3].max() + 1  # a tie: the first index wins
    logits[4, :] = 0.5  # a whole row tied
    rows = logits.shape[0]
    greedy = torch.ones(rows, device=DEVICE)
    out = gumbel_argmax(logits, torch.ones(rows, device=DEVICE), greedy,
                        torch.arange(rows, device=DEVICE, dtype=torch.int64))
    assert out.tolist() == logits.float().argmax(dim=-1).tolist()
    assert out[3] == 5 and out[4] == 0
    ref = gumbel_argmax_reference(logits, torch.ones(rows), greedy, torch.zeros(rows, dtype=torch.int64))
    assert out.tolist() == ref.tolist()


def test_a_seed_draws_the_same_token_wherever_its_row_is():
    g = torch.Generator().manual_seed(1)
    row = torch.randn(VOCAB, generator=g)
    logits = torch.stack([row] * 6 + [torch.randn(VOCAB, generator=g)]).to(DEVICE)
    seeds = torch.tensor([11, 12, 11, 13, 12, 11, 11], device=DEVICE)
    t = torch.full((7,), 5.0, device=DEVICE)  # hot: different seeds almost surely differ
    out = gumbel_argmax(logits, t, torch.zeros(7, device=DEVICE), seeds).tolist()
    assert out[0] == out[2] == out[5] and out[1] == out[4]
    assert len({out[0], out[1], out[3]}) > 1


@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_draws_follow_the_tempered_softmax(temperature):
    """2,000 draws (rows with distinct seeds) from one row of 8 tokens that matter (the rest
    at -inf), against softmax(x / T): a chi-square test at the 0.1% level (with 7 degrees of
    freedom, critical value 24.3). A draw from softmax(x) instead of softmax(x / T) puts the
    statistic in the hundreds, so the test has near-certain power against that mistake."""
    n, width = 2000, 64
    x = torch.full((width,), float("-inf"))
    x[:8] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3])
    logits = x.repeat(n, 1).to(DEVICE)
    out = gumbel_argmax(logits, torch.full((n,), temperature, device=DEVICE), torch.zeros(n, device=DEVICE),
                        torch.arange(n, device=DEVICE, dtype=torch.int64) * 7919 + 1).cpu()
    assert out.max() < 8
    counts = torch.bincount(out, minlength=8).double()
    expected = n * torch.softmax(x[:8].double() / temperature, dim=0)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3, (chi2, counts.tolist(), expected.tolist())


def test_one_row_cut_in_slices_finds_the_first_maximum():
    """A lone row is read by many programs (one slice each) and their bests merged: the
    merged token is still the first maximum, wherever it lies, and a row of -inf gives 0."""
    g = torch.Generator().manual_seed(2)
    for where in (0, VOCAB // 2 + 3, VOCAB - 1):
        logits = torch.randn(1, VOCAB, generator=g).to(DEVICE)
        logits[0, where] = logits[0, VOCAB - 1 - where // 2] = 9.0  # a tie: the smaller index wins
        out = gumbel_argmax(logits, torch.ones(1, device=DEVICE), torch.ones(1, device=DEVICE),
                            torch.zeros(1, device=DEVICE, dtype=torch.int64))
        assert out.tolist() == logits.argmax(dim=-1).tolist()
    dead = torch.full((1, VOCAB), float("-inf"), device=DEVICE)
    out = gumbel_argmax(dead, torch.ones(1, device=DEVICE), torch.zeros(1, device=DEVICE),
                        torch.zeros(1, device=DEVICE, dtype=torch.int64))
    assert out.tolist() == [0]
