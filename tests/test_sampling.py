"""Sampling: the filters, the Gumbel-max draw, seeds, stop conditions and log-probabilities.

The filters and the draw are tested as functions with hand-computed expectations and with
hypothesis; the request-level features (seeds, min/max tokens, stop strings and ids, EOS,
logprobs) through the engine on a tiny random model with a tiny tokenizer.
"""
import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.layers.sampled_tokens import SamplerOutput
from minivllm.layers.sampler import Sampler, gumbel_max_sample, min_p_mask, top_k_mask, top_p_mask

NEG_INF = float("-inf")
pytestmark = pytest.mark.usefixtures("one_thread")


def kept(masked: torch.Tensor) -> list[int]:
    return [i for i, x in enumerate(masked.tolist()) if x != NEG_INF]


# -- the filters, by hand ---------------------------------------------------------------


def test_top_k_mask():
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0, 4.0]] * 4)
    out = top_k_mask(logits, torch.tensor([2, 1, 0, 9]))
    assert kept(out[0]) == [3, 4]
    assert kept(out[1]) == [3]
    assert kept(out[2]) == [0, 1, 2, 3, 4]  # 0: no limit
    assert kept(out[3]) == [0, 1, 2, 3, 4]  # k beyond the vocabulary: no limit
    assert torch.equal(out[0, [3, 4]], logits[0, [3, 4]])  # kept logits are untouched
    # Ties at the boundary are kept.
    assert kept(top_k_mask(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), torch.tensor([2]))[0]) == [0, 1, 2]


def test_top_p_mask():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (0), 0.05 (2)
    logits = probs.log().expand(5, 4)
    out = top_p_mask(logits, torch.tensor([0.4, 0.7, 0.85, 0.96, 1.0]))
    assert kept(out[0]) == [1]  # 0.5 >= 0.4
    assert kept(out[1]) == [1, 3]  # 0.5 < 0.7 <= 0.8
    assert kept(out[2]) == [0, 1, 3]  # 0.8 < 0.85 <= 0.95
    assert kept(out[3]) == [0, 1, 2, 3]
    assert kept(out[4]) == [0, 1, 2, 3]


def test_min_p_mask():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log().expand(4, 4)
    out = min_p_mask(logits, torch.tensor([0.0, 0.2, 0.5, 0.7]))
    assert kept(out[0]) == [0, 1, 2, 3]
    assert kept(out[1]) == [0, 1, 3]  # threshold 0.1
    assert kept(out[2]) == [1, 3]  # threshold 0.25
    assert kept(out[3]) == [1]  # threshold 0.35


# -- the filters, by property -----------------------------------------------------------

logit_rows = st.lists(st.floats(-6, 6, allow_nan=False, width=32), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(logit_rows, st.integers(0, 45))
def test_top_k_property(row, k):
    out = top_k_mask(torch.tensor([row]), torch.tensor([k]))[0]
    if k == 0 or k >= len(row):
        expected = list(range(len(row)))
    else:
        kth = sorted(row, reverse=True)[k - 1]
        expected = [i for i, x in enumerate(row) if x >= kth]
    assert kept(out) == expected


@settings(max_examples=200, deadline=None)
@given(logit_rows, st.floats(0.01, 1.0))
def test_top_p_property(row, p):
    out = top_p_mask(torch.tensor([row]), torch.tensor([p]))[0]
    probs = torch.tensor(row, dtype=torch.float64).softmax(-1).tolist()
    keep = kept(out)
    drop = [i for i in range(len(row)) if i not in keep]
    assert keep, "top-p always keeps the most likely token"
    kept_probs = [probs[i] for i in keep]
    # The most likely tokens ...
    assert not drop or min(kept_probs) >= max(probs[i] for i in drop) - 1e-6
    # ... as few as reach p: enough mass, and not enough without the least likely of them.
    eps = 1e-5
    assert sum(kept_probs) >= p - eps
    assert sum(kept_probs) - min(kept_probs) < p + eps


@settings(max_examples=200, deadline=None)
@given(logit_rows, st.floats(0.0, 1.0))
def test_min_p_property(row, min_p):
    out = min_p_mask(torch.tensor([row]), torch.tensor([min_p]))[0]
    probs = torch.tensor(row, dtype=torch.float64).softmax(-1).tolist()
    threshold = max(probs) * min_p
    keep = set(kept(out))
    assert probs.index(max(probs)) in keep
    for i, q in enumerate(probs):
        if abs(q - threshold) > 1e-6 * max(1.0, threshold):  # float32 may round either way at the edge
            assert (i in keep) == (q >= threshold), (i, q, threshold)


# -- the draw ---------------------------------------------------------------------------

CHI2_3DF_999 = 16.27  # chi-square, 3 degrees of freedom: exceeded with probability 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    nonzero = probs > 0
    return float(((counts[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]).sum())


def test_gumbel_max_frequencies_match_probabilities():
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5, 0.0])
    n = 40_000
    noise = torch.empty(n, 5).exponential_(generator=torch.Generator().manual_seed(0))
    draws = gumbel_max_sample(probs.expand(n, 5), noise)
    counts = torch.bincount(draws, minlength=5).double()
    assert counts[4] == 0  # probability zero: never drawn
    assert chi_square(counts, probs.double()) < CHI2_3DF_999
    # A wrong draw (e.g. argmax of probs + noise) would be far off: check the test can tell.
    wrong = torch.bincount((probs.expand(n, 5) + noise).argmax(-1), minlength=5).double()
    assert chi_square(wrong, probs.double()) > 100


def test_sampler_draws_from_the_filtered_tempered_distribution():
    """temperature 0.5 squares the probabilities; top_k=3 then drops the least likely."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20_000
    logits = probs.log().expand(n, 4).clone()
    params = [SamplingParams(temperature=0.5, top_k=3)] * n
    torch.manual_seed(0)
    tokens = torch.tensor(Sampler()(logits, params, [None] * n).token_ids)
    target = torch.tensor([0.0, 0.04, 0.09, 0.16], dtype=torch.float64)
    target /= target.sum()
    counts = torch.bincount(tokens, minlength=4).double()
    assert counts[0] == 0
    assert chi_square(counts, target) < 13.82  # 2 degrees of freedom, p = 0.001


def test_temperature_zero_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6),
              SamplingParams(temperature=0)]
    out = Sampler()(logits.clone(), params, [None] * 6)
    greedy = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 3, 4, 5)] == [greedy[i] for i in (0, 2, 3, 4, 5)]
    # A banned token (e.g. EOS before min_tokens) is never chosen, even when it is the argmax.
    banned = Sampler()(logits.clone(), params, [None] * 6, banned=[[greedy[0]], [], [], [], [], []])
    assert banned.token_ids[0] == logits[0].topk(2).indices[1].item()


def test_an_all_greedy_batch_takes_one_argmax(monkeypatch):
    """On the GPU a batch of greedy rows skips the noise kernel and its per-row settings: the
    tokens are still torch.argmax's, ties to the first index; one row with a temperature
    sends the batch back through the draw (here, as on a GPU, by use_triton)."""
    import minivllm.layers.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "use_triton", lambda x: True)
    draws = []
    draw = Sampler._draw
    monkeypatch.setattr(Sampler, "_draw", lambda self, *a: draws.append(len(a[1])) or draw(self, *a))
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits[2, 7] = logits[2, 41] = logits[2].max() + 1  # a tie
    logits[4] = 0.25  # a whole row tied
    greedy = [SamplingParams(temperature=0)] * 5
    out = Sampler()(logits.clone(), greedy, [None] * 5)
    assert out.token_ids == logits.float().argmax(-1).tolist() and out.token_ids[2] == 7 and out.token_ids[4] == 0
    assert draws == [], "an all-greedy batch must not run the noise kernel"
    mixed = Sampler()(logits.clone(), greedy[:4] + [SamplingParams(temperature=0.8, seed=3)], [None] * 5)
    assert draws == [5] and mixed.token_ids[:4] == out.token_ids[:4]


# -- through the engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_qwen3_with_tokenizer):
    return LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=256, block_size=8)


def one(llm, prompt, params):
    [out] = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0]


PROMPT = "To be, or not to be"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_qwen3_with_tokenizer, llm):
    seeded = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = one(llm, PROMPT, seeded).token_ids
    assert len(alone) == 12
    assert one(llm, PROMPT, seeded).token_ids == alone
    others = ["Hello, world!", [5, 6, 7, 8, 9] * 7, "The quick brown fox jumps over the lazy dog."]
    neighbours = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.1, seed=99, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    ]
    batch = llm.generate([others[0], PROMPT, others[1], others[2]],
                         [neighbours[0], seeded, neighbours[1], neighbours[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    # Also when the batch is scheduled quite differently: a tiny pool (preemptions) and a
    # tiny token budget (chunked prefills).
    small = LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=12, block_size=4, max_num_batched_tokens=7,
                record_trace=True)
    batch = small.generate([others[1], others[0], PROMPT, others[2]],
                           [neighbours[1], neighbours[0], seeded, neighbours[2]], use_tqdm=False)
    assert any(r.preempted for r in small.engine.trace)
    assert batch[2].outputs[0].token_ids == alone
    # Another seed draws other tokens.
    other_seed = SamplingParams(**{**seeded.__dict__, "seed": 4321})
    assert one(llm, PROMPT, other_seed).token_ids != alone


def test_max_tokens(llm):
    out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None


@pytest.fixture(scope="module")
def greedy_run(llm):
    """A greedy completion without stop conditions, to take stop strings and tokens from."""
    out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len(out.text) >= 8 and len(set(out.token_ids)) >= 3
    return out


def test_stop_token_ids(llm, greedy_run):
    toks = greedy_run.token_ids
    stop = toks[2]
    k = toks.index(stop)
    out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]))
    assert out.token_ids == toks[: k + 1]  # the stop token is returned ...
    assert out.finish_reason == "stop" and out.stop_reason == stop
    tok = llm.get_tokenizer()
    # ... but not in the text (where a trailing incomplete UTF-8 character stays held back).
    assert out.text == tok.decode(toks[:k]).rstrip("\ufffd")


def test_min_tokens_holds_back_stop_tokens(llm, greedy_run):
    toks = greedy_run.token_ids
    stop = toks[1]
    out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=6, stop_token_ids=[stop]))
    assert stop not in out.token_ids[:6]
    assert len(out.token_ids) >= 7
    if out.finish_reason == "stop":
        assert out.token_ids.index(stop) == len(out.token_ids) - 1
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 16 and stop not in out.token_ids


def piece_ends(tokenizer, token_ids) -> list[int]:
    """Where each token's text ends in the decoded completion."""
    return [len(tokenizer.decode(token_ids[: i + 1])) for i in range(len(token_ids))]


def test_stop_strings(llm, greedy_run):
    text, toks = greedy_run.text, greedy_run.token_ids
    ends = piece_ends(llm.get_tokenizer(), toks)
    boundary = next(e for e in ends if e >= len(text) // 2 and e < len(text))
    for stop in (text[boundary - 1 : boundary + 1],  # spans two tokens
                 text[len(text) - 3 :]):  # at the very end
        at = text.find(stop)
        out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=[stop, "never appears"]))
        assert out.text == text[:at], stop  # truncated before the stop string
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == toks[: len(out.token_ids)]
        assert out.token_ids, "at least the token that completed the stop string"
    # A stop string that never appears changes nothing.
    out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, stop="never appears", ignore_eos=True))
    assert out.text == text and out.finish_reason == "length"


@pytest.fixture(scope="module")
def eos_llm(tiny_qwen3_with_tokenizer, greedy_run, tmp_path_factory):
    """The same model, with a token it emits early declared as its end-of-sequence token."""
    path = tmp_path_factory.mktemp("eos-qwen3")
    shutil.copytree(tiny_qwen3_with_tokenizer, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = greedy_run.token_ids[2]
    (path / "config.json").write_text(json.dumps(config))
    return LLM(model=str(path), num_kv_blocks=64, block_size=8)


def test_eos_ignore_eos_and_min_tokens(eos_llm, greedy_run):
    toks = greedy_run.token_ids
    eos = toks[2]
    k = toks.index(eos)
    out = one(eos_llm, PROMPT, SamplingParams(temperature=0, max_tokens=16))
    assert out.token_ids == toks[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = one(eos_llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out.token_ids == toks and out.finish_reason == "length"
    out = one(eos_llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=k + 3))
    assert eos not in out.token_ids[: k + 3] and len(out.token_ids) > k + 3
    assert out.token_ids[:k] == toks[:k]  # the same until EOS would have been drawn


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_with_tokenizer):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_with_tokenizer, dtype=torch.float32).eval()


def hf_logprobs(hf_model, prompt_ids, output_ids) -> torch.Tensor:
    """log_softmax of transformers' logits at each position that produced an output token."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].double()
    return logits.log_softmax(-1)[len(prompt_ids) - 1 :]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=1.3, seed=5, max_tokens=8, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=6, max_tokens=4, logprobs=0, ignore_eos=True),
    # Banned tokens (here: every even id, held back by min_tokens) do not change the
    # log-probabilities reported: they are the model's, before any processing.
    SamplingParams(temperature=0.8, seed=7, max_tokens=5, min_tokens=5, logprobs=2, stop_token_ids=list(range(0, 512, 2))),
], ids=["greedy-top3", "sampled-top2", "sampled-top0", "banned-top2"])
def test_logprobs_match_transformers(llm, hf_model, params):
    [result] = llm.generate([PROMPT], params, use_tqdm=False)
    out = result.outputs[0]
    tok = llm.get_tokenizer()
    ref = hf_logprobs(hf_model, result.prompt_token_ids, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == params.max_tokens
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token in entry
        assert abs(entry[token].logprob - ref[step, token].item()) < 1e-4
        total += entry[token].logprob
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items())[: params.logprobs]
        assert [r for r, _ in ranked] == list(range(1, params.logprobs + 1))
        assert [tid for _, tid in ranked] == ref[step].topk(params.logprobs).indices.tolist()
        assert len(entry) in (params.logprobs, params.logprobs + 1)
        if len(entry) > params.logprobs:  # the chosen token, outside the top n
            assert entry[token].rank > params.logprobs
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref[step, tid].item()) < 1e-4
            assert lp.decoded_token == tok.decode([tid])
        if params.stop_token_ids:
            assert token % 2 == 1
        # The chosen token's rank is its place in the model's distribution.
        assert entry[token].rank == 1 + int((ref[step] > ref[step, token]).sum())
        if params.temperature == 0:
            assert entry[token].rank == 1
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-6)


def test_no_logprobs_unless_asked(llm):
    out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=3))
    assert out.logprobs is None and out.cumulative_logprob is None


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", dict(temperature=-0.1)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.1)),
    ("seed", dict(seed="7")),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**64)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=2.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=["ok", 3])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("logprobs", dict(logprobs=21)),
])
def test_invalid_sampling_params(field, kwargs):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_valid_sampling_params_edges():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    # The ends of every allowed range are allowed.
    SamplingParams(top_p=1.0, min_p=1.0, min_tokens=4, max_tokens=4, logprobs=20, top_k=1)
    SamplingParams(max_tokens=None, min_tokens=100, min_p=0.0, logprobs=0)


class LongPieces:
    """A stand-in detokenizer whose every token decodes to a long piece of text."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def step(self, token_ids):
        return self.pieces.pop(0)


def test_stop_string_inside_a_long_delta(llm):
    """A token's text can be long (runs of spaces or dashes in real vocabularies), and a
    stop string anywhere in it must be found, at its first occurrence."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=5, stop=["STOP"])
    rid = engine.add_request([1, 2, 3], params, request_id="long-pieces")
    request = engine.requests[rid]
    engine.step()  # prefill and a first token, the ordinary way
    assert request.seq in engine.scheduler.running
    text = request.text
    # The engine's own post-processing of two more tokens, with long pieces of text.
    request.detokenizer = LongPieces(["a" * 10, "b" * 100 + "STOP" + "c" * 100 + "STOP"])
    engine._emit(request, SamplerOutput([5], [None]), range(1))
    assert request.seq.finish_reason is None
    engine._emit(request, SamplerOutput([6], [None]), range(1))
    assert request.text == text + "a" * 10 + "b" * 100
    assert request.seq.finish_reason == "stop" and request.stop_reason == "STOP"
    del engine.requests[rid]  # as step() does for a finished request
    assert not engine.has_unfinished_requests()


def test_min_tokens_and_stop_strings(llm, greedy_run):
    """As in vLLM, stop conditions apply once min_tokens tokens exist: a stop string that
    the min_tokens-th token completes stops the request; one completed earlier does not."""
    text, toks = greedy_run.text, greedy_run.token_ids
    ends = piece_ends(llm.get_tokenizer(), toks)
    stop = text[len(text) // 2 - 2 : len(text) // 2]
    at = text.find(stop)
    done_by = next(i + 1 for i, e in enumerate(ends) if e >= at + len(stop))  # tokens when it completes
    assert done_by >= 2
    out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=done_by, stop=stop))
    assert out.finish_reason == "stop" and out.text == text[:at] and len(out.token_ids) == done_by
    out = one(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=done_by + 1, stop=stop))
    assert len(out.token_ids) > done_by and out.text.startswith(text[: at + len(stop)])


def test_stop_ids_outside_the_vocabulary_are_harmless(llm, greedy_run):
    """A stop id the model cannot produce (here 10_000, vocabulary 512) never stops a
    request, and holding it back for min_tokens must not break the step for anyone."""
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=3, stop_token_ids=[10_000], ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT], [params, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy_run.token_ids] * 2
