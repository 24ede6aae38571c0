"""Rejection sampling for a general draft distribution (``rejection_sample``): the emitted
tokens are distributed as the target's, whatever the draft; and for a point-mass draft it is
the engine's rule (``num_accepted`` on tokens sampled from the target).

The statistical tests use Pearson's chi-square test on counts from N fixed-seed trials (so
each run is the same run), at significance level ALPHA. Their power is stated, computed
here and checked: Pearson's statistic under an alternative law p' is (asymptotically)
noncentral chi-square with noncentrality lambda = N sum_i (p'_i - p_i)^2 / p_i, and by
Cauchy-Schwarz lambda >= 4 N TV(p, p')^2. So a rule whose law is at total variation >= delta
from p is detected with at least the power at lambda = 4 N delta^2; ``detectable_tv`` finds
the delta with 99% power. Each test also runs deliberately wrong rules through the same
check: their exact total variation from p must exceed that delta, and the test must reject
them.

That the engine's greedy output with speculation is token for token the output without it
is tested in tests/test_spec_decode.py (test_greedy_identical_with_and_without,
test_bundled_model_greedy_identical); its sampled output's distribution there too.
"""
import itertools
import math

import pytest
import torch

from minivllm.spec_decode.verify import num_accepted, rejection_sample

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-4  # the test's false-rejection rate, were the seeds drawn afresh
POWER = 0.99
N = 20_000  # trials per statistical test


# -- the chi-square test and its power -------------------------------------------------

def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)."""
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)).item()


def chi2_critical(alpha: float, df: int) -> float:
    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def noncentral_power(lam: float, critical: float, df: int) -> float:
    """P(X > critical) for X ~ noncentral chi-square(df, lam): a Poisson(lam / 2) mixture of
    chi-square(df + 2j)."""
    j = torch.arange(0, 4000, dtype=torch.float64)
    weights = torch.exp(-lam / 2 + j * math.log(lam / 2) - torch.lgamma(j + 1))
    return float((weights * torch.special.gammaincc(df / 2 + j, torch.full_like(j, critical / 2))).sum())


def detectable_tv(n: int, df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The total variation shift that n trials detect with probability >= power."""
    critical = chi2_critical(alpha, df)
    lo, hi = 1e-6, 500.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if noncentral_power(mid, critical, df) < power else (lo, mid)
    return math.sqrt(hi / (4 * n))


def chi2_rejects(counts: torch.Tensor, probs: torch.Tensor, alpha: float = ALPHA) -> bool:
    """Pearson's test of counts against the law probs (cells of probability 0 must be empty)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    if (counts[probs == 0] > 0).any():
        return True
    keep = probs > 0
    expected = n * probs[keep]
    statistic = float(((counts[keep] - expected) ** 2 / expected).sum())
    return chi2_sf(statistic, int(keep.sum()) - 1) < alpha


def test_the_power_calculation():
    # The textbook critical value (chi-square, 5 degrees of freedom, alpha = 0.05) ...
    assert chi2_critical(0.05, 5) == pytest.approx(11.0705, abs=1e-3)
    # ... and noncentral power against a Monte Carlo estimate.
    g = torch.Generator().manual_seed(0)
    lam, df, c = 20.0, 4, chi2_critical(1e-3, 4)
    mean = torch.zeros(df, dtype=torch.float64)
    mean[0] = math.sqrt(lam)
    x = ((torch.randn(200_000, df, generator=g, dtype=torch.float64) + mean) ** 2).sum(1)
    assert noncentral_power(lam, c, df) == pytest.approx(float((x > c).double().mean()), abs=0.005)


# -- distributions -----------------------------------------------------------------

def random_law(g: torch.Generator, vocab: int) -> torch.Tensor:
    """A non-degenerate distribution: no token below 2% of the mass."""
    w = torch.rand(vocab, generator=g, dtype=torch.float64) + 0.1
    return w / w.sum()


def law_of_first_token(p: torch.Tensor, q: torch.Tensor, accept: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The exact law of the first emitted token for a rule that accepts a draft x ~ q with
    probability accept[x] and otherwise draws from residual (unnormalised)."""
    rejected = float((q * (1 - accept)).sum())
    return q * accept + rejected * residual / residual.sum()


# The rules a reader might write instead of Leviathan et al.'s, as (acceptance probability of
# each token, residual); "p / q without the min" is not among them: for u < 1, u < p/q and
# u < min(1, p/q) are the same test.
WRONG_RULES = {
    "accept iff u < q/p": lambda p, q: (torch.clamp(q / p, max=1), torch.clamp(p - q, min=0)),
    "accept iff u < p (q ignored)": lambda p, q: (p, torch.clamp(p - q, min=0)),
    "resample from p, not the residual": lambda p, q: (torch.clamp(p / q, max=1), p),
    "resample from max(q - p, 0)": lambda p, q: (torch.clamp(p / q, max=1), torch.clamp(q - p, min=0)),
}


def wrong_first_token(rule: str, p: torch.Tensor, q: torch.Tensor, x: int, u: float, g: torch.Generator) -> int:
    accept, residual = WRONG_RULES[rule](p, q)
    if u < accept[x]:
        return x
    return int(torch.multinomial(residual, 1, generator=g))


def draws(law: torch.Tensor, n: int, g: torch.Generator) -> list[int]:
    return torch.multinomial(law, n, replacement=True, generator=g).tolist()


# -- the emitted token is distributed as p -----------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_token_is_distributed_as_the_target(seed):
    """d = 3 drafts, each drawn from its own q_j; the first emitted token over N trials
    against p_0, with the deliberately wrong rules run through the same test."""
    vocab, d = 6, 3
    g = torch.Generator().manual_seed(seed)
    p = torch.stack([random_law(g, vocab) for _ in range(d + 1)])
    q = torch.stack([random_law(g, vocab) for _ in range(d)])
    delta = detectable_tv(N, vocab - 1)
    assert delta < 0.03  # N = 20,000, 6 cells: any law at TV >= ~0.025 from p_0 is caught w.p. 99%
    x = torch.tensor([draws(q[j], N, g) for j in range(d)]).T  # [N, d]: the drafts of each trial
    u = torch.rand(N, d, generator=g, dtype=torch.float64)
    counts = torch.zeros(vocab)
    lengths = torch.zeros(d + 2)
    for t in range(N):
        emitted = rejection_sample(p, q, x[t], u[t], g)
        counts[emitted[0]] += 1
        lengths[len(emitted)] += 1
    assert not chi2_rejects(counts, p[0]), (counts / N, p[0])
    # The acceptance rate of the first draft is 1 - TV(p_0, q_0) = sum min(p_0, q_0).
    accepted = float(lengths[2:].sum()) / N
    assert accepted == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=4.5 * math.sqrt(0.25 / N))
    for rule in WRONG_RULES:
        accept, residual = WRONG_RULES[rule](p[0], q[0])
        tv = float((law_of_first_token(p[0], q[0], accept, residual) - p[0]).abs().sum()) / 2
        assert tv > delta, f"{rule}: TV {tv:.4f} is below what the test detects ({delta:.4f}): choose other p, q"
        wrong = torch.zeros(vocab)
        for t in range(N):
            wrong[wrong_first_token(rule, p[0], q[0], int(x[t, 0]), float(u[t, 0]), g)] += 1
        assert chi2_rejects(wrong, p[0]), f"the test does not reject the wrong rule {rule!r} (TV {tv:.3f})"


def test_two_tokens_follow_the_target_given_the_first():
    """A draft model's two drafts (x_1 drawn from q_1 given x_0) and a target whose p_1
    depends on x_0: the first two tokens of the output, completed by one ordinary draw
    from the target when the step emitted one, must have the target's joint law
    p_0(t0) p_1(t1 | t0)."""
    vocab = 4
    g = torch.Generator().manual_seed(5)
    p0, q0 = random_law(g, vocab), random_law(g, vocab)
    p1 = torch.stack([random_law(g, vocab) for _ in range(vocab)])  # p1[a]: the target after token a
    q1 = torch.stack([random_law(g, vocab) for _ in range(vocab)])  # q1[a]: the draft after token a
    p2 = random_law(g, vocab)  # the bonus position's law (not checked here)
    counts = torch.zeros(vocab, vocab)
    for _ in range(N):
        x0 = draws(q0, 1, g)[0]
        x1 = draws(q1[x0], 1, g)[0]
        target = torch.stack([p0, p1[x0], p2])
        emitted = rejection_sample(target, torch.stack([q0, q1[x0]]), torch.tensor([x0, x1]),
                                   torch.rand(2, generator=g, dtype=torch.float64), g)
        second = emitted[1] if len(emitted) > 1 else draws(p1[emitted[0]], 1, g)[0]
        counts[emitted[0], second] += 1
    joint = p0[:, None] * p1
    assert detectable_tv(N, vocab * vocab - 1) < 0.035
    assert not chi2_rejects(counts, joint), (counts / N, joint)


# -- a point-mass draft: the engine's rule ------------------------------------------------

def engine_rule_law(p: torch.Tensor, drafts: list[int]) -> dict[tuple, float]:
    """The exact law of what the engine emits: y_j ~ p_j at every position, the longest
    prefix where drafts match, then the target's token (``num_accepted``)."""
    law: dict[tuple, float] = {}
    vocab = p.shape[1]
    for y in itertools.product(range(vocab), repeat=len(drafts) + 1):
        prob = math.prod(float(p[j, t]) for j, t in enumerate(y))
        emitted = y[: num_accepted(drafts, list(y)) + 1]
        law[emitted] = law.get(emitted, 0.0) + prob
    return law


def test_one_hot_draft_is_the_engine_rule():
    """For q = one-hot(x) the rule accepts x_j iff u_j < p_j(x_j) and otherwise draws from p_j
    without x_j: the emitted sequences have exactly the law of the engine's num_accepted
    rule, checked by a chi-square test over every possible emitted sequence."""
    vocab, drafts = 3, [2, 0]
    g = torch.Generator().manual_seed(7)
    p = torch.stack([random_law(g, vocab) for _ in range(len(drafts) + 1)])
    q = torch.nn.functional.one_hot(torch.tensor(drafts), vocab).double()
    # The deterministic part: the acceptance threshold is p_0(x_0) itself.
    x0 = drafts[0]
    assert rejection_sample(p, q, torch.tensor(drafts), torch.tensor([float(p[0, x0]) - 1e-9, 0.0], dtype=torch.float64), g)[0] == x0
    assert rejection_sample(p, q, torch.tensor(drafts), torch.tensor([float(p[0, x0]) + 1e-9, 0.0], dtype=torch.float64), g)[0] != x0
    law = engine_rule_law(p, drafts)
    cells = sorted(law)
    counts = torch.zeros(len(cells))
    for _ in range(N):
        emitted = tuple(rejection_sample(p, q, torch.tensor(drafts), torch.rand(2, generator=g, dtype=torch.float64), g))
        assert emitted in law, f"{emitted} is not something the engine's rule can emit"
        counts[cells.index(emitted)] += 1
    assert not chi2_rejects(counts, torch.tensor([law[c] for c in cells])), (counts / N, law)


def test_shapes_are_checked():
    p, q = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p[:2], q, torch.tensor([0, 1]), torch.rand(2))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, q[:, :3], torch.tensor([0, 1]), torch.rand(2))
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample(p, q, torch.tensor([0, 1]), torch.rand(3))
    assert len(rejection_sample(p[:1], q[:0], torch.tensor([], dtype=torch.long), torch.rand(0))) == 1  # no drafts: the bonus
