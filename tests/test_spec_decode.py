"""Speculative decoding (chapter 19): the n-gram proposer, the acceptance rule, and the
engine with speculation on, which must give what it gives with speculation off: token for
token for greedy requests (with chunked prefill, preemption, stop strings, min_tokens,
logprobs, max_tokens inside an accepted run), and the same distribution for sampled ones."""
import collections
import itertools
import random

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.cuda_graphs import DECODE, VERIFY
from minivllm.spec_decode import SpeculativeConfig, num_accepted, propose_ngram
from minivllm.testing import make_tiny_checkpoint
from shared import same_outputs as same

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# -- the proposer ----------------------------------------------------------------------

def test_propose_longest_match_first():
    # The last 2 tokens (5, 6) occur at 0 followed by 9; the last token 6 alone occurs more
    # recently at 4, followed by 8. The longer match wins.
    assert propose_ngram([5, 6, 9, 1, 6, 8, 5, 6], k=1, min_n=1, max_n=2) == [9]
    assert propose_ngram([5, 6, 9, 1, 6, 8, 5, 6], k=1, min_n=1, max_n=1) == [8]


def test_propose_most_recent_occurrence():
    assert propose_ngram([1, 2, 3, 1, 2, 4, 1, 2], k=2, min_n=2, max_n=2) == [4, 1]


def test_propose_none_found():
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []
    assert propose_ngram([1, 2, 3, 4, 2, 3], k=3, min_n=3, max_n=3) == []  # only a 2-gram repeats
    assert propose_ngram([7], k=3, min_n=1, max_n=3) == []


def test_propose_truncated_at_the_end():
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], k=5, min_n=2, max_n=3) == [3, 1, 2]
    assert propose_ngram([4, 4, 4, 4], k=3, min_n=1, max_n=3) == [4]  # "4 4 4" at 0, then one 4
    assert propose_ngram([1, 2, 3, 1, 2], k=0, min_n=1, max_n=2) == []


def test_propose_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        want = []
        for n in range(hi, lo - 1, -1):
            if n >= len(tokens):
                continue
            starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
            if starts:
                want = tokens[starts[-1] + n : starts[-1] + n + k]
                break
        assert propose_ngram(tokens, k, lo, hi) == want, (tokens, k, lo, hi)


# -- the acceptance rule ---------------------------------------------------------------

def test_num_accepted():
    assert num_accepted([], [5]) == 0
    assert num_accepted([1, 2, 3], [1, 2, 3, 9]) == 3
    assert num_accepted([1, 2, 3], [1, 7, 3, 9]) == 1
    assert num_accepted([1, 2, 3], [0, 2, 3, 9]) == 0


def test_acceptance_preserves_the_target_distribution_exactly():
    """Enumerate every draw: a step verifies drafts (x1, x2) by drawing y_j from the target
    at each position, emits the accepted drafts and the first mismatch, and the next step
    continues from there. The first two emitted tokens must have exactly the target's joint
    distribution p(t0) p(t1 | t0), whatever the drafts."""
    vocab = 3
    g = torch.Generator().manual_seed(0)

    def p(prefix):  # the target's next-token distribution after `prefix` (any fixed function)
        h = hash(tuple(prefix)) % 1000
        w = torch.rand(vocab, generator=torch.Generator().manual_seed(h)) + 0.05
        return (w / w.sum()).double()

    for drafts in itertools.product(range(vocab), repeat=2):
        got = torch.zeros(vocab, vocab, dtype=torch.float64)
        dists = [p([]), p(drafts[:1]), p(drafts)]
        for y in itertools.product(range(vocab), repeat=3):
            prob = dists[0][y[0]] * dists[1][y[1]] * dists[2][y[2]]
            a = num_accepted(list(drafts), list(y))
            emitted = list(y[: a + 1])
            if len(emitted) >= 2:
                got[emitted[0], emitted[1]] += prob
            else:  # the next step draws t1 from the target after t0 (its own drafts aside)
                got[emitted[0]] += prob * p(emitted)
        want = torch.stack([p([])[t] * p([t]) for t in range(vocab)])
        assert torch.allclose(got, want, atol=1e-12), drafts
    del g


# -- the engine: refusals ---------------------------------------------------------------

def test_speculative_config_refusals(tiny_qwen3, hybrid_checkpoint):
    with pytest.raises(ValueError, match="method=.eagle. is not implemented yet; implemented: ngram, draft_model"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"})
    with pytest.raises(ValueError, match="speculative_config needs async_scheduling=False"):
        LLM(str(tiny_qwen3), num_kv_blocks=16, speculative_config=NGRAM, async_scheduling=True)
    # A hybrid model speculates too (tests/test_spec_hybrid.py), with k states per slot to roll back to.
    hybrid = LLM(str(hybrid_checkpoint("qwen3_next")), num_kv_blocks=16, speculative_config=NGRAM)
    assert all(layer.spec_recurrent_states.shape[1] == NGRAM["num_speculative_tokens"]
               for layer in hybrid.engine.runner.state_layers)
    llm = LLM(str(tiny_qwen3), num_kv_blocks=32, speculative_config=NGRAM)
    for params, name in [(SamplingParams(n=2), "n"), (SamplingParams(prompt_logprobs=1), "prompt_logprobs")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{name} is not supported with speculative_config"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3  # the refusals left the engine working


def test_structured_outputs_refused(tiny_qwen3_with_tokenizer):
    from minivllm.sampling_params import StructuredOutputsParams

    llm = LLM(str(tiny_qwen3_with_tokenizer), num_kv_blocks=32, speculative_config=NGRAM)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="structured_outputs is not supported with speculative_config"):
        llm.generate(["hi"], params, use_tqdm=False)


# -- the engine: the same outputs --------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec"), family="qwen3", seed=11, with_tokenizer=True)


def workload(seed: int, n: int = 24):
    """Prompts that repeat themselves (so n-gram drafts get accepted) and random ones, with
    every kind of greedy request."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 3 == 2:
            prompts.append([rng.randrange(3, 500) for _ in range(rng.randint(1, 50))])
        else:
            unit = [rng.randrange(3, 500) for _ in range(rng.randint(1, 6))]
            prompts.append((unit * 20)[: rng.randint(4, 60)])
    params = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=30, logprobs=3))
        elif kind == 2:
            params.append(SamplingParams(temperature=0, max_tokens=35, min_tokens=10))
        elif kind == 3:
            params.append(SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[7, 8, 9]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=None))  # until EOS or the context's end
    return prompts, params


def accepted(llm) -> int:
    return llm.engine.stats["spec_accepted_tokens"]


@pytest.mark.parametrize("engine_args", [
    dict(num_kv_blocks=512, block_size=8),  # roomy: prefix hits
    dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=8),  # chunking and preemption
], ids=["roomy", "tight"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_with_and_without(checkpoint, engine_args, k):
    plain = LLM(str(checkpoint), **engine_args)
    spec = LLM(str(checkpoint), record_trace=True, **engine_args,
               speculative_config=dict(NGRAM, num_speculative_tokens=k))
    prompts, params = workload(k)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    same(want, got)
    assert accepted(spec) > 0, "no draft was ever accepted: the test does not exercise acceptance"
    assert spec.engine.stats["spec_draft_tokens"] > accepted(spec), "no draft was ever rejected"
    if "max_num_batched_tokens" in engine_args:
        assert any(r.preempted for r in spec.engine.trace), "the tight pool never preempted"
    # A decode verifying drafts is traced as a decode of 1 + d tokens.
    assert any(kind == "decode" and n > 1 for r in spec.engine.trace for _, n, kind in r.seqs)
    bm = spec.engine.block_manager
    assert not spec.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])
    metrics = [o.spec_decode for o in got if o.spec_decode is not None]
    assert metrics and all(0 <= m.acceptance_rate <= 1 and 1 <= m.mean_accepted_length <= k + 1 for m in metrics)


def test_max_tokens_bounds_the_drafts(checkpoint):
    """Drafts never run past max_tokens (a step emits at most one token more than its
    drafts), so every max_tokens ends exactly there, identically, and the blocks go back."""
    plain = LLM(str(checkpoint), num_kv_blocks=128, block_size=4)
    spec = LLM(str(checkpoint), num_kv_blocks=128, block_size=4,
               speculative_config=dict(NGRAM, num_speculative_tokens=5))
    prompt = [11, 12, 13] * 10
    for max_tokens in range(1, 14):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        got = spec.generate([prompt], params, use_tqdm=False)
        same(plain.generate([prompt], params, use_tqdm=False), got)
        assert len(got[0].outputs[0].token_ids) == max_tokens
    assert accepted(spec) > 5
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_stop_strings_and_min_tokens_identical(checkpoint):
    plain = LLM(str(checkpoint), num_kv_blocks=256, block_size=8)
    spec = LLM(str(checkpoint), num_kv_blocks=256, block_size=8, speculative_config=NGRAM)
    prompt = "a b c a b c a b c a b c"
    [full] = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    text = full.outputs[0].text
    cases = [SamplingParams(temperature=0, max_tokens=40, stop=[text[8:11]]),
             SamplingParams(temperature=0, max_tokens=40, stop=[text[15:17]], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=20, stop_token_ids=list(full.outputs[0].token_ids[3:6])),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=5)]
    for params in cases:
        want = plain.generate([prompt], params, use_tqdm=False)
        same(want, spec.generate([prompt], params, use_tqdm=False))
        if params.stop:
            assert want[0].outputs[0].finish_reason == "stop", params  # the stop really is hit
    assert accepted(spec) > 0


def test_bundled_model_greedy_identical():
    plain, spec = LLM(num_kv_blocks=128), LLM(num_kv_blocks=128, speculative_config=NGRAM)
    prompts = ["The cat sat on the mat. The cat sat on the mat. The cat sat",
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
               "one two three four one two three four one two",
               "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    same(plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False))
    assert accepted(spec) > 0


# -- sampled requests ------------------------------------------------------------------

def test_seeded_sampling_reproducible(checkpoint):
    spec = LLM(str(checkpoint), num_kv_blocks=256, block_size=8, speculative_config=NGRAM)
    prompts = [[21, 22, 23] * 8, [40, 41] * 10, [5, 6, 7, 8]]
    params = [SamplingParams(temperature=0.8, top_k=5, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    first = spec.generate(prompts, params, use_tqdm=False)
    again = spec.generate(prompts[::-1], params[::-1], use_tqdm=False)[::-1]  # other batch order
    same(first, again)
    assert accepted(spec) > 0


def test_sampled_distribution_matches_without_speculation(checkpoint):
    """The second and third generated tokens over n = 1000 seeds, with and without
    speculation: two samples of one distribution each if speculation preserves it. The
    prompt is the model's own greedy loop, so that its likely tokens are in the prompt and
    get drafted (for the second token; max_tokens=3 leaves room for one draft).

    Bounds: with top_k=3 the second token takes at most m = 9 values and the third 27. The
    expected total variation distance between two empirical distributions of n draws over
    m values is at most sqrt(2m / n) / 2 (0.067 and 0.116), and McDiarmid's inequality (one
    draw moves it by at most 1/n) puts it above that plus 0.083 with probability below
    exp(-n 0.083^2) = 0.001: the bounds 0.15 and 0.2. Power: low. The engine emits the
    target's own samples (the drafts only decide how many), so the second token is right
    by construction, and a rule that accepted every draft moves the third token's
    distribution by only TV 0.08 here (measured): it passes. The exact test above is the
    one that checks the rule; this one checks that the engine's rows reach the sampler in
    an order that keeps seeded requests' draws independent. (The seeds are fixed, so
    the test is deterministic.)"""
    plain = LLM(str(checkpoint), num_kv_blocks=512, block_size=8)
    spec = LLM(str(checkpoint), num_kv_blocks=512, block_size=8, speculative_config=NGRAM)
    start = [31, 32, 33] * 3
    [loop] = plain.generate([start], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    prompt = start + list(loop.outputs[0].token_ids)
    n = 1000
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    outs = [llm.generate([prompt] * n, params, use_tqdm=False) for llm in (plain, spec)]
    assert spec.engine.stats["spec_draft_tokens"] > n / 5, "too few drafts: the test would not test them"
    assert accepted(spec) > 0, "no draft accepted"
    for position, values, bound in ((1, 9, 0.15), (2, 27, 0.2)):
        counts = [collections.Counter(o.outputs[0].token_ids[position] for o in run) for run in outs]
        keys = set(counts[0]) | set(counts[1])
        assert len(keys) <= values
        tv = sum(abs(counts[0][k] - counts[1][k]) for k in keys) / 2 / n
        print(f"token {position}: total variation {tv:.3f}")
        assert tv < bound, (position, tv, counts)


# -- serving ---------------------------------------------------------------------------

def test_server_with_speculation_counts_drafts_in_metrics(checkpoint):
    import httpx
    import openai

    from minivllm.server import AsyncLLMEngine
    from minivllm.server.api import ServerThread, build_app

    offline = LLM(str(checkpoint), num_kv_blocks=256, block_size=8)
    engine = AsyncLLMEngine(LLM(str(checkpoint), num_kv_blocks=256, block_size=8, speculative_config=NGRAM).engine)
    prompt = "a b c a b c a b c a b c a b c"
    [want] = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    with ServerThread(build_app(engine, "tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.outputs[0].text
        page = httpx.get(server.url + "/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
              if line.startswith("vllm:spec_decode_num_")}
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= values["vllm:spec_decode_num_accepted_tokens_total"] > 0


def test_cli_flag_takes_json():
    import argparse

    from minivllm.cli import add_engine_args, engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_args(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}


def test_penalised_requests_are_not_speculated(checkpoint):
    """Penalties read the tokens a row has seen; a draft row would need its own history,
    so such a request decodes one token a step, identically, beside speculated ones."""
    plain = LLM(str(checkpoint), num_kv_blocks=256, block_size=8)
    spec = LLM(str(checkpoint), num_kv_blocks=256, block_size=8, speculative_config=NGRAM)
    prompts = [[21, 22, 23] * 8, [21, 22, 23] * 8]
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    got = spec.generate(prompts, params, use_tqdm=False)
    same(plain.generate(prompts, params, use_tqdm=False), got)
    assert got[0].spec_decode is None and got[1].spec_decode is not None


@pytest.mark.gpu
def test_greedy_identical_on_gpu_with_cuda_graphs():
    """On a GPU: decode steps replay CUDA graphs, verifying steps their verify graphs
    (batches of up to 24 padded to the next captured size); the outputs must still be those
    of speculation off, token for token, on the bundled model (in float32: in bfloat16 a
    verifying chunk and a decode step may round a near tie apart)."""
    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife. However little known the feelings or views of such a man may be on "
            "his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding "
            "families, that he is considered the rightful property of some one or other of their daughters.")
    prompts = [text + "\n\n" + text[:300], text, "one two three four one two three four one two"] * 8
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, logprobs=1)
    plain = LLM(device="cuda", dtype="float32", async_scheduling=False, gpu_memory_utilization=0.3)
    want = plain.generate(prompts, params, use_tqdm=False)
    del plain
    spec = LLM(device="cuda", dtype="float32", gpu_memory_utilization=0.3,
               speculative_config=dict(NGRAM, num_speculative_tokens=4))
    same(want, spec.generate(prompts, params, use_tqdm=False), logprob_tol=1e-3)
    runner = spec.engine.runner
    assert sum(runner.cudagraphs.replays_of(DECODE).values()) > 0
    assert runner.cudagraphs.dispatcher.verify_query_len == 5
    assert sum(n for bs, n in runner.cudagraphs.replays_of(VERIFY).items() if bs > 1) > 0
    assert accepted(spec) > 0


def test_block_manager_shrink_gives_back_the_blocks_past_the_end():
    from minivllm.engine.block_manager import BlockManager
    from minivllm.engine.sequence import Sequence

    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(list(range(6)), SamplingParams())
    bm.allocate(seq)
    seq.num_computed_tokens = 6
    bm.grow(seq, 1 + 5)  # the last token and 5 drafts: positions up to 11, three blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.shrink(seq, 7)  # one draft accepted: positions 0..6 are the sequence's
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.check_invariants([seq])
    bm.shrink(seq, 8)  # nothing past the end to give back
    assert len(seq.block_table) == 2
