"""Penalties, logit bias, allowed token ids and bad words: each against a plain-torch
reference (a loop over rows and tokens) on random logits, then through the engine, where a
greedy run that uses them must be the same with and without asynchronous scheduling (a
request's newest token is then still on the device when the next step is sampled).
"""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.engine import sampler_inputs
from minivllm.layers.logits_processors import TokenHistory, process_logits
from minivllm.layers.penalties import repetition_penalty
from minivllm.layers.sampler import Sampler

NEG_INF = float("-inf")
VOCAB = 64
pytestmark = pytest.mark.usefixtures("one_thread")


# -- references: one row, one token at a time ------------------------------------------


def ref_penalties(row: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float,
                  repetition: float) -> torch.Tensor:
    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t in set(output):
        row[t] -= frequency * output.count(t) + presence
    return row


def ref_bad_words(row: torch.Tensor, output: list[int], words: list[list[int]]) -> torch.Tensor:
    row = row.clone()
    for w in words:
        prefix = w[:-1]
        if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :] == prefix):
            row[w[-1]] = NEG_INF
    return row


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_the_reference(seed):
    rng = random.Random(seed)
    rows = 6
    logits = torch.randn(rows, VOCAB) * 3
    prompts = [random_ids(rng, rng.randrange(1, 20)) for _ in range(rows)]
    outputs = [random_ids(rng, rng.randrange(0, 30)) for _ in range(rows)]
    # Some rows' newest token is on the "device" (asynchronous scheduling): in pending_tokens.
    pending_tokens = torch.tensor(random_ids(rng, 4))
    pending = [rng.choice([-1, 0, 1, 2, 3]) for _ in range(rows)]
    params = [SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                             repetition_penalty=rng.uniform(0.5, 2.0)) for _ in range(rows - 1)]
    params.append(SamplingParams())  # a row with no penalty in the same batch stays untouched
    history = TokenHistory(prompts, outputs, pending, pending_tokens, [[] for _ in range(rows)])
    out = process_logits(logits.clone(), params, history)
    for r, p in enumerate(params):
        seen = outputs[r] + ([pending_tokens[pending[r]].item()] if pending[r] >= 0 else [])
        ref = ref_penalties(logits[r], prompts[r], seen, p.presence_penalty, p.frequency_penalty,
                            p.repetition_penalty)
        torch.testing.assert_close(out[r], ref)
    torch.testing.assert_close(out[-1], logits[-1])


def test_repetition_penalty_over_prompt_and_output():
    """Positive logits are divided and negative ones multiplied, for tokens of the prompt as
    well as of the output; nothing else moves."""
    logits = torch.randn(3, VOCAB)
    seen = torch.rand(3, VOCAB) < 0.3
    penalty = torch.tensor([1.7, 0.6, 1.0])
    out = repetition_penalty(logits, seen, penalty)
    for r in range(3):
        for t in range(VOCAB):
            x = logits[r, t]
            want = (x / penalty[r] if x > 0 else x * penalty[r]) if seen[r, t] else x
            torch.testing.assert_close(out[r, t], want)


@pytest.mark.parametrize("seed", range(3))
def test_logit_bias_and_allowed_token_ids_match_the_reference(seed):
    rng = random.Random(seed)
    logits = torch.randn(4, VOCAB)
    biases = [{t: rng.uniform(-100, 100) for t in random_ids(rng, 5)}, None, {3: 7.5}, None]
    allowed = [None, random_ids(rng, 6), [1, 2], None]
    params = [SamplingParams(logit_bias=b, allowed_token_ids=a) for b, a in zip(biases, allowed)]
    out = process_logits(logits.clone(), params, None)
    for r in range(4):
        ref = logits[r].clone()
        if allowed[r] is not None:
            ref = torch.where(torch.isin(torch.arange(VOCAB), torch.tensor(allowed[r])), ref, NEG_INF)
        for t, b in (biases[r] or {}).items():
            ref[t] += b
        torch.testing.assert_close(out[r], ref)


@pytest.mark.parametrize("seed", range(5))
def test_bad_words_match_the_reference(seed):
    rng = random.Random(seed)
    rows = 5
    logits = torch.randn(rows, VOCAB)
    outputs = [random_ids(rng, rng.randrange(0, 8)) for _ in range(rows)]
    pending_tokens = torch.tensor(random_ids(rng, 3))
    pending = [rng.choice([-1, 0, 2]) for _ in range(rows)]
    words = []
    for r in range(rows):
        seen = outputs[r] + ([pending_tokens[pending[r]].item()] if pending[r] >= 0 else [])
        # Words whose prefix is the tail (they must ban), random words (they mostly do not),
        # a one-token word (always banned), and a word longer than the output so far.
        row_words = [random_ids(rng, rng.randrange(1, 4)) for _ in range(3)]
        for k in (1, 2, 3):
            if len(seen) >= k:
                row_words.append(seen[len(seen) - k :] + random_ids(rng, 1))
        row_words.append(random_ids(rng, len(seen) + 3))
        words.append(row_words)
    words[-1] = []  # a row without bad words
    history = TokenHistory([[] for _ in range(rows)], outputs, pending, pending_tokens, words)
    out = process_logits(logits.clone(), [SamplingParams()] * rows, history)
    for r in range(rows):
        seen = outputs[r] + ([pending_tokens[pending[r]].item()] if pending[r] >= 0 else [])
        torch.testing.assert_close(out[r], ref_bad_words(logits[r], seen, words[r]))


def test_greedy_sampling_takes_the_processed_argmax():
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(temperature=0, repetition_penalty=3.0), SamplingParams(temperature=0, logit_bias={5: 50}),
              SamplingParams(temperature=0, allowed_token_ids=[7, 9])]
    history = TokenHistory([[logits[0].argmax().item()], [], []], [[], [], []], [-1] * 3, None, [[], [], []])
    out = Sampler()(logits.clone(), params, [None] * 3, history=history)
    want = process_logits(logits.clone(), params, history).argmax(-1).tolist()
    assert out.token_ids == want
    assert out.token_ids[1] == 5 and out.token_ids[2] in (7, 9)
    assert out.token_ids[0] != logits[0].argmax().item() or logits[0].max() <= 0


def test_nothing_is_built_when_no_row_uses_them(monkeypatch, tiny_qwen3_with_tokenizer):
    logits = torch.randn(2, VOCAB)
    assert process_logits(logits, [SamplingParams(), SamplingParams(temperature=0)], None) is logits
    llm = LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=64, block_size=8)

    def fail(*args):
        raise AssertionError("token_history built for a batch that uses no penalty")

    monkeypatch.setattr(sampler_inputs, "token_history", fail)
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, logit_bias={3: 1.0}), use_tqdm=False)


# -- through the engine -----------------------------------------------------------------

PROMPT = "To be, or not to be, that is the question"


@pytest.fixture(scope="module")
def llms(tiny_qwen3_with_tokenizer):
    """The same engine synchronous and asynchronous (the CPU default is synchronous)."""
    return [LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=128, block_size=8, async_scheduling=a)
            for a in (False, True)]


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_with_tokenizer):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_with_tokenizer, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy decoding with transformers' logits and the reference penalties."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt_ids + out])).logits[0, -1].float()
        logits = ref_penalties(logits, prompt_ids, out, params.presence_penalty, params.frequency_penalty,
                               params.repetition_penalty)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("kwargs", [dict(repetition_penalty=1.8), dict(presence_penalty=1.5),
                                    dict(frequency_penalty=0.9), dict(repetition_penalty=1.2, presence_penalty=0.8, frequency_penalty=-0.3)])
def test_penalties_through_the_engine_match_transformers(llms, hf_model, kwargs):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kwargs)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for llm in llms:
        # In a batch with a request that uses no penalty, which must not change.
        with_penalty, without = llm.generate([PROMPT, PROMPT], [params, plain], use_tqdm=False)
        want = hf_greedy(hf_model, with_penalty.prompt_token_ids, 12, params)
        assert with_penalty.outputs[0].token_ids == want
        assert without.outputs[0].token_ids == hf_greedy(hf_model, without.prompt_token_ids, 12, plain)
    assert want != hf_greedy(hf_model, with_penalty.prompt_token_ids, 12, plain), "the penalty changes nothing here"


def test_logit_bias_and_allowed_token_ids_through_the_engine(llms):
    for llm in llms:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    logit_bias={17: 100}), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [17] * 6
        allowed = [40, 41, 300]
        out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True,
                                                    allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
        assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 20


def contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i : i + len(word)] == word for i in range(len(ids) - len(word) + 1))


def test_bad_words_through_the_engine(llms):
    tok = llms[0].get_tokenizer()
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    greedy = llms[0].generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
    # A two-token word the greedy run writes: the first pair of its tokens that the
    # tokenizer gives back as the same pair, from their text.
    word = next(tok.decode(greedy[i : i + 2]) for i in range(len(greedy) - 1)
                if tok.encode(tok.decode(greedy[i : i + 2]).lstrip(), add_special_tokens=False) == greedy[i : i + 2])
    single = tok.decode([greedy[0]])
    for bad in ([word], [single.strip() or single]):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=bad)
        banned = [w for w in llms[0].engine.input_processor.bad_word_ids(params)]
        outs = [llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids for llm in llms]
        assert outs[0] == outs[1]
        assert outs[0] != greedy
        assert not any(contains(outs[0], w) for w in banned), (bad, banned, outs[0])


def test_everything_at_once_is_the_same_synchronous_and_asynchronous(llms):
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.2, bad_words=["the", "to be"], logit_bias={9: 2.0, 11: -3.0}),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, allowed_token_ids=list(range(50, 120)),
                       frequency_penalty=1.0),
        SamplingParams(temperature=0.8, seed=11, max_tokens=9, ignore_eos=True, presence_penalty=-1.0),
    ]
    prompts = [PROMPT, "Hello, world!", [5, 6, 7, 8, 9] * 3, "The quick brown fox"]
    sync, asyn = ([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)] for llm in llms)
    assert [o.token_ids for o in sync] == [o.token_ids for o in asyn]
    assert [o.text for o in sync] == [o.text for o in asyn]


def test_include_stop_str_in_output(llms):
    llm = llms[0]
    full = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    at = full.find(stop)
    for include, want in ((False, full[:at]), (True, full[: at + len(stop)])):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop,
                                include_stop_str_in_output=include)
        for one in llms:
            out = one.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
            assert out.text == want and out.stop_reason == stop and out.finish_reason == "stop"
    # A stop token's text is kept too.
    ids = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[ids[3]], include_stop_str_in_output=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == ids[3] and out.text == llm.get_tokenizer().decode(out.token_ids)


def test_truncate_prompt_tokens(llms):
    llm = llms[0]
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=4)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-4:]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    direct = llm.generate([{"prompt_token_ids": ids[-4:]}], plain, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    # More than the prompt has: the prompt is kept whole.
    whole = llm.generate([PROMPT], SamplingParams(**{**plain.__dict__, "truncate_prompt_tokens": 1000}),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("field,kwargs", [
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=float("nan"))),
    ("frequency_penalty", dict(frequency_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty="1")),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("repetition_penalty", dict(repetition_penalty=float("inf"))),
    ("logit_bias", dict(logit_bias={1: 101})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={"5": 1.0})),
    ("logit_bias", dict(logit_bias=[(1, 2.0)])),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[1, -3])),
    ("bad_words", dict(bad_words=["ok", ""])),
    ("bad_words", dict(bad_words="word")),
    ("include_stop_str_in_output", dict(include_stop_str_in_output=1)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=2.0)),
])
def test_invalid_params(field, kwargs):
    with pytest.raises(ValueError, match=rf"\b{field}\b") as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


def test_valid_edges():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3, logit_bias={0: -100, 1: 100},
                   allowed_token_ids=[0], bad_words=[], truncate_prompt_tokens=1, include_stop_str_in_output=True)


@pytest.mark.parametrize("field,kwargs", [
    ("logit_bias", dict(logit_bias={512: 1.0})),
    ("allowed_token_ids", dict(allowed_token_ids=[3, 512])),
])
def test_token_ids_outside_the_vocabulary_are_refused(llms, field, kwargs):
    llm = llms[0]
    vocab = llm.engine.runner.model_config.vocab_size
    assert vocab == 512
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was left half-admitted


def test_bad_words_need_a_tokenizer(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), num_kv_blocks=32, block_size=8)
    with pytest.raises(ValueError, match=r"\bbad_words\b"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(bad_words=["x"]), use_tqdm=False)
