"""Chapter 19 — speculative decoding: the accept/reject test of rejection sampling and its
residual, and the n-gram proposer's lookup.

Your ``accept_or_residual`` (in ``rejection_sample``, exercises/minivllm/spec_decode/verify.py)
is checked exactly first: on hand-made distributions, draft by draft at the acceptance
threshold min(1, p(x) / q(x)) from both sides, and on random distributions and uniforms
(hypothesis), where which drafts are accepted is a function of the inputs alone, and a
rejected position's token must come from where max(p - q, 0) is positive. Then by
statistics, on fixed seeds: the tokens drawn at rejections must follow the normalised
residual, and the first emitted token must follow the target's p whatever the draft q
(Pearson's chi-square test over 20,000 trials at significance 1e-6; with 6 tokens it
catches any law at total variation >= 0.03 from the right one with probability > 99%).

Your ``ngram_lookup`` (in ``propose_ngram``, exercises/minivllm/spec_decode/ngram.py) is
checked on hand-made lists that tell the most recent occurrence from the oldest and what
follows a match from one token off, against a brute force on random lists (hypothesis), and
inside the engine, whose greedy output with your proposer must be the output without
speculation.
"""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.spec_decode.ngram import propose_ngram
from minivllm.spec_decode.verify import rejection_sample

SIGNIFICANCE = 1e-6


def law(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float64)
    return w / w.sum()


def uniforms(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df)."""
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)).item()


def follows(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's chi-square test: could counts be draws from probs (at SIGNIFICANCE)?"""
    counts, probs = counts.double(), probs.double()
    if (counts[probs == 0] > 0).any():
        return False
    keep = probs > 0
    expected = counts.sum() * probs[keep]
    statistic = float(((counts[keep] - expected) ** 2 / expected).sum())
    return chi2_sf(statistic, int(keep.sum()) - 1) >= SIGNIFICANCE


# -- accept or reject, exactly --------------------------------------------------------

# Three positions over 5 tokens, p and q chosen by hand:
P = torch.stack([law(1, 2, 3, 2.5, 1.5), law(2, 1, 4, 2, 1), law(1, 1, 1, 1, 6), law(3, 1, 1, 1, 4)])
Q = torch.stack([law(3, 1, 1, 2, 3), law(1, 2, 4, 2, 1), law(2, 3, 2, 2, 1)])
# Position 0, draft 1: p/q = 0.2/0.1 = 2, always accepted. Position 1, draft 1: p/q = 0.1/0.2 =
# 0.5. Position 2, draft 1: p/q = 0.1/0.3 = 1/3.
DRAFTS = torch.tensor([1, 1, 1])


def test_ch19_accepts_below_the_threshold_and_only_there():
    g = torch.Generator().manual_seed(0)
    assert rejection_sample(P, Q, DRAFTS, uniforms(0.999, 0.49, 0.3), g)[:3] == [1, 1, 1], (
        "u_0 = 0.999 < min(1, p/q = 2) = 1, u_1 = 0.49 < 0.5 and u_2 = 0.3 < 1/3: all three drafts are accepted")
    got = rejection_sample(P, Q, DRAFTS, uniforms(0.999, 0.49, 0.3), g)
    assert len(got) == 4, f"every draft accepted: the three drafts and the bonus token, got {got}"
    got = rejection_sample(P, Q, DRAFTS, uniforms(0.999, 0.51, 0.0), g)
    assert got[0] == 1 and len(got) == 2, (
        f"got {got}: u_1 = 0.51 >= min(1, p/q) = 0.5 rejects the second draft, and the step ends with one token "
        "drawn from the residual (u_2 = 0, which would accept, is never looked at)")
    assert got[1] != 1, f"got {got}: a rejected position's token comes from max(p - q, 0), which is 0 at the draft"
    got = rejection_sample(P, Q, DRAFTS, uniforms(0.999, 0.0, 0.34), g)
    assert got[:2] == [1, 1] and len(got) == 3, f"got {got}: u_2 = 0.34 >= 1/3 rejects the third draft only"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.integers(2, 12), d=st.integers(1, 5))
def test_ch19_which_drafts_are_accepted(seed, vocab, d):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(d + 1, vocab, generator=g, dtype=torch.float64) ** 3  # some tokens nearly 0
    p /= p.sum(1, keepdim=True)
    q = torch.rand(d, vocab, generator=g, dtype=torch.float64) ** 3
    q /= q.sum(1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[j], 1, generator=g)[0] for j in range(d)])
    u = torch.rand(d, generator=g, dtype=torch.float64)
    got = rejection_sample(p, q, drafts, u, g)
    ratio = [float(p[j, drafts[j]] / q[j, drafts[j]]) for j in range(d)]
    accepted = next((j for j in range(d) if not u[j] < min(1.0, ratio[j])), d)
    assert len(got) == accepted + 1 and got[:accepted] == drafts[:accepted].tolist(), (
        f"uniforms {u.tolist()}, p(x)/q(x) per draft {ratio}: drafts {drafts.tolist()} must be accepted while "
        f"u_j < min(1, p_j(x_j) / q_j(x_j)), so {accepted} of them, then one more token; got {got}")
    if accepted < d:
        j, token = accepted, got[-1]
        assert p[j, token] > q[j, token], (
            f"the token {token} drawn at the rejected position {j} has p = {float(p[j, token]):.4f} <= q = "
            f"{float(q[j, token]):.4f}: the residual max(p - q, 0) is 0 there (do not draw from p or from q)")


def test_ch19_rejected_tokens_follow_the_residual():
    # Draft 0 (p/q = 0.1/0.5) is rejected whenever u >= 0.2: here always.
    p, q = law(1, 3, 2, 2.5, 1.5), law(5, 1, 2, 1, 1)
    residual = torch.clamp(p - q, min=0)
    residual /= residual.sum()
    g = torch.Generator().manual_seed(19)
    n = 20_000
    counts = torch.zeros(5)
    for _ in range(n):
        got = rejection_sample(torch.stack([p, p]), q[None], torch.tensor([0]), uniforms(0.5), g)
        assert len(got) == 1, f"u = 0.5 >= min(1, p/q) = 0.2 rejects the draft: one token, got {got}"
        counts[got[0]] += 1
    assert follows(counts, residual), (
        f"the tokens drawn at rejections have frequencies {(counts / n).tolist()}; the residual "
        f"normalize(max(p - q, 0)) is {residual.tolist()}")


def test_ch19_the_first_token_follows_the_target():
    """Drafts drawn from q; whatever q, the first emitted token must be distributed as p_0."""
    g = torch.Generator().manual_seed(7)
    vocab, d, n = 6, 2, 20_000
    p = torch.rand(d + 1, vocab, generator=g, dtype=torch.float64) + 0.1
    p /= p.sum(1, keepdim=True)
    q = torch.rand(d, vocab, generator=g, dtype=torch.float64) + 0.1
    q /= q.sum(1, keepdim=True)
    counts = torch.zeros(vocab)
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(q[j], 1, generator=g)[0] for j in range(d)])
        counts[rejection_sample(p, q, drafts, torch.rand(d, generator=g, dtype=torch.float64), g)[0]] += 1
    assert follows(counts, p[0]), (
        f"the first emitted token has frequencies {(counts / n).tolist()}, the target's law is {p[0].tolist()}: "
        "accept with probability min(1, p/q), and at a rejection draw from max(p - q, 0)")


# -- the n-gram lookup -------------------------------------------------------------------

def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@pytest.mark.parametrize("tokens, k, min_n, max_n, want, why", [
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, 2, 2, [4, 1],
     "(1, 2) occurs at 0 and at 3: the most recent (3) is followed by 4, 1 (the oldest by 3, 1)"),
    ([7, 8, 9, 5, 7, 8], 3, 1, 2, [9, 5, 7],
     "(7, 8) occurs at 0: what follows it starts right after the match, at index 2"),
    ([5, 6, 9, 1, 6, 8, 5, 6], 1, 1, 2, [9],
     "the longest suffix that occurs earlier wins: (5, 6) at 0, followed by 9 (not 6 alone at 4, followed by 8)"),
    ([5, 6, 9, 1, 6, 8, 5, 6], 1, 1, 1, [8], "n = 1 only: the last 6 before the end is at 4, followed by 8"),
    ([1, 2, 3, 1, 2, 3, 1, 2], 5, 2, 3, [3, 1, 2],
     "(3, 1, 2) occurs at 2; at most the 3 tokens up to the end of the list follow it"),
    ([4, 4, 4, 4], 3, 1, 3, [4], "(4, 4, 4) occurs at 0 (overlapping the suffix itself), followed by one 4"),
    ([1, 2, 3, 4, 2, 3], 3, 3, 3, [], "(4, 2, 3) never occurs before: nothing to propose"),
    ([3, 1, 4, 1], 2, 1, 3, [4, 1], "only (1,) occurs earlier: at 1, followed by 4, 1"),
], ids=["most-recent", "right-after", "longest-first", "n=1", "to-the-end", "overlap", "none", "shorter"])
def test_ch19_ngram_by_hand(tokens, k, min_n, max_n, want, why):
    got = propose_ngram(tokens, k, min_n, max_n)
    assert got == want, f"propose_ngram({tokens}, k={k}, min_n={min_n}, max_n={max_n}) = {got}, expected {want}: {why}"
    assert all(type(t) is int for t in got), "return a list of Python ints (.tolist())"


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=40), k=st.integers(1, 6),
       min_n=st.integers(1, 3), extra=st.integers(0, 2))
def test_ch19_ngram_matches_brute_force(tokens, k, min_n, extra):
    want = brute_force(tokens, k, min_n, min_n + extra)
    got = propose_ngram(tokens, k, min_n, min_n + extra)
    assert got == want, f"propose_ngram({tokens}, k={k}, min_n={min_n}, max_n={min_n + extra}) = {got}, expected {want}"


def test_ch19_your_proposer_in_the_engine(tiny_qwen3):
    """The engine drafts with your propose_ngram: its greedy output must be the output
    without speculation (a bad draft is only rejected), and on prompts that repeat
    themselves some drafts must be accepted."""
    rng = random.Random(19)
    prompts = [([rng.randrange(3, 500) for _ in range(rng.randint(1, 5))] * 12)[: rng.randint(8, 40)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_qwen3), num_kv_blocks=128, block_size=8)
    spec = LLM(str(tiny_qwen3), num_kv_blocks=128, block_size=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3})
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for w, o in zip(want, got):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
    assert spec.engine.stats["spec_accepted_tokens"] > 0, "no draft was accepted on prompts that repeat themselves"


# --- verification: num_accepted and after_sample ------------------------------------------


@pytest.mark.parametrize("drafts, sampled, want, why", [
    ([], [7], 0, "no drafts: nothing to accept"),
    ([1, 2, 3], [1, 2, 3, 4], 3, "every draft confirmed: all accepted (the bonus 4 is never compared)"),
    ([1, 2, 3], [1, 9, 3, 4], 1, "stop at the first mismatch, even if a later draft matches"),
    ([1, 2, 3], [5, 2, 3, 4], 0, "the first draft rejected: none accepted"),
    ([4, 4], [4, 4, 4], 2, "repeated tokens"),
])
def test_ch19_num_accepted(drafts, sampled, want, why):
    from minivllm.spec_decode.verify import num_accepted

    assert num_accepted(drafts, sampled) == want, why


class _Seq:
    def __init__(self, computed, finished=False, slot=None):
        self.num_computed_tokens, self.is_finished, self.state_slot = computed, finished, slot


class _Request:
    def __init__(self, seq):
        self.seq = seq
        self.num_draft_tokens = self.num_accepted_tokens = self.num_spec_steps = 0


class _Step:
    def __init__(self, requests, drafts, first_rows):
        self.requests, self.drafts, self.first_rows = requests, drafts, first_rows
        self.accepted = [None] * len(requests)


class _Recorder:
    def __init__(self):
        self.calls = []

    def shrink(self, seq, num_tokens):
        self.calls.append(("shrink", seq, num_tokens))

    def keep_accepted_states(self, slots, accepted):
        self.calls.append(("keep", slots, accepted))


def _speculation():
    from minivllm.spec_decode.feature import Speculation

    recorder = _Recorder()
    stats = {}
    spec = Speculation(proposer=None, num_speculative_tokens=3, max_model_len=100, scheduler=None,
                       block_manager=recorder, runner=recorder, state_of=None, stats=stats)
    return spec, recorder, stats


class _Sampled:
    def __init__(self, token_ids):
        self.token_ids = token_ids


def test_ch19_after_sample_accepts_rolls_back_and_counts():
    spec, recorder, stats = _speculation()
    a, b, c = _Seq(13), _Seq(20), _Seq(8)
    ra, rb, rc = _Request(a), _Request(b), _Request(c)
    # rows: a's 4 (3 drafts), b's 1 (no drafts), c's 3 (2 drafts)
    step = _Step([ra, rb, rc], [[5, 6, 7], [], [8, 9]], [0, 4, 5])
    sampled = _Sampled([5, 6, 1, 2, 30, 8, 9, 4])
    assert spec.after_sample(step, sampled, None) == [], "after_sample has no outputs of its own"
    assert step.accepted == [2, 0, 2], f"a accepts 5, 6 (not 7); b has no drafts; c accepts both: got {step.accepted}"
    assert a.num_computed_tokens == 12, "a's one rejected draft is taken back from its computed tokens"
    assert c.num_computed_tokens == 8 and b.num_computed_tokens == 20, "nothing rejected: nothing taken back"
    assert ("shrink", a, 13) in recorder.calls, "a gives back the blocks past its tokens plus the one this step appends"
    assert ("shrink", c, 9) in recorder.calls, "every request with drafts shrinks to its tokens plus one"
    assert not any(call[1] is b for call in recorder.calls), "a request without drafts is left alone"
    assert (ra.num_draft_tokens, ra.num_accepted_tokens, ra.num_spec_steps) == (3, 2, 1), "the request's own counts"
    assert (rb.num_draft_tokens, rb.num_spec_steps) == (0, 0), "no drafts: no verifying step counted"
    assert stats == {"spec_draft_tokens": 5, "spec_accepted_tokens": 4, "spec_verify_steps": 2}, (
        f"the engine's counts over the step: 5 drafts, 4 accepted, 2 verifying sequences; got {stats}")
    assert not any(call[0] == "keep" for call in recorder.calls), "no state slots: no states to put back"


def test_ch19_after_sample_finished_sequences_and_hybrid_states():
    spec, recorder, stats = _speculation()
    done, hyb1, hyb2 = _Seq(10, finished=True), _Seq(30, slot=4), _Seq(40, slot=7)
    step = _Step([_Request(done), _Request(hyb1), _Request(hyb2)], [[1, 2], [3, 3, 3], [5]], [0, 3, 7])
    spec.after_sample(step, _Sampled([1, 9, 0, 3, 4, 0, 0, 5, 6]), None)
    assert step.accepted == [1, 1, 1], f"accepted drafts are recorded even for a finished sequence: {step.accepted}"
    assert done.num_computed_tokens == 10 and not any(call[1] is done for call in recorder.calls), (
        "a sequence that finished in this step is not rolled back")
    assert stats["spec_verify_steps"] == 2 and stats["spec_draft_tokens"] == 4, "a finished sequence is not counted"
    assert hyb1.num_computed_tokens == 28, "two rejected drafts taken back"
    keeps = [call for call in recorder.calls if call[0] == "keep"]
    assert keeps == [("keep", [4], [1])], (
        "one call for the step: the slots whose state ran past rejected drafts, with how many each accepted "
        f"(a sequence that accepted all keeps its state as it is); got {keeps}")


def test_ch19_after_sample_without_drafts_does_nothing():
    spec, recorder, stats = _speculation()
    step = _Step([_Request(_Seq(5))], [[]], [0])
    assert spec.after_sample(step, _Sampled([3]), None) == []
    assert recorder.calls == [] and stats == {"spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                                              "spec_verify_steps": 0}, "a step without drafts changes nothing"


def test_ch19_the_bonus_token_comes_from_the_last_position():
    target = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    draft = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    got = rejection_sample(target, draft, torch.tensor([1, 2]), torch.tensor([0.5, 0.5]))
    assert got == [1, 2, 3], f"both drafts accepted, then the bonus drawn from p_d (the last row): got {got}"
