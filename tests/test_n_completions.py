"""SamplingParams.n: n completions of one prompt, the prompt computed once.

The first sequence computes the prompt; when its last prompt token's logits are there, n
tokens are sampled from them and the sequence forks: the others take its block table (the
blocks' reference counts go up), and the partly filled last block is copied on write, by
whichever sequence writes into it first while it is shared. Each completion must be exactly
what a separate request would give (a seeded completion i draws as a request with seed + i).
"""
import random

import pytest

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = list(range(5, 25))  # 20 tokens: two full blocks of 8 and a partial one


@pytest.fixture(scope="module")
def llms(tiny_qwen3_with_tokenizer):
    return {a: LLM(str(tiny_qwen3_with_tokenizer), num_kv_blocks=256, block_size=8, async_scheduling=a,
                   record_trace=True) for a in (False, True)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_completion_is_what_a_separate_request_gives(llms, async_scheduling):
    llm = llms[async_scheduling]
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True, logprobs=2)
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    separate = llm.generate([PROMPT] * 4, [SamplingParams(temperature=1.0, top_p=0.95, seed=7 + i, max_tokens=12,
                                                          ignore_eos=True, logprobs=2) for i in range(4)],
                            use_tqdm=False)
    for completion, alone in zip(out.outputs, separate):
        assert completion.token_ids == alone.outputs[0].token_ids
        assert completion.text == alone.outputs[0].text
        assert completion.cumulative_logprob == pytest.approx(alone.outputs[0].cumulative_logprob, abs=1e-4)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "the completions should differ"
    # Greedy: n identical completions, each the single greedy one.
    [greedy] = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=10), use_tqdm=False)
    [single] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert all(c.token_ids == single.outputs[0].token_ids for c in greedy.outputs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def test_the_prompt_is_computed_once_and_its_blocks_shared(llms):
    """n = 8 against 8 separate requests (no prefix cache, so the comparison is the forks
    alone): the prompt's tokens computed, and the blocks held after the first decode step."""
    llm = llms[False]
    llm.engine.block_manager.enable_prefix_caching = False
    try:
        runs = {}
        for name, prompts, params in [
            ("n=8", [PROMPT], SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)),
            ("8 requests", [PROMPT] * 8, [SamplingParams(temperature=1.0, seed=1 + i, max_tokens=4, ignore_eos=True)
                                          for i in range(8)]),
        ]:
            llm.engine.trace.clear()
            outs = llm.generate(prompts, params, use_tqdm=False)
            trace = llm.engine.trace
            runs[name] = {"prefill_tokens": sum(r.num_prefill_tokens for r in trace),
                          "blocks_after_first_decode": trace[1].blocks_in_use,
                          "tokens": [c.token_ids for o in outs for c in o.outputs]}
    finally:
        llm.engine.block_manager.enable_prefix_caching = True
    assert runs["n=8"]["tokens"] == runs["8 requests"]["tokens"]
    assert runs["n=8"]["prefill_tokens"] == 20 and runs["8 requests"]["prefill_tokens"] == 160
    # After one decode step: the two full prompt blocks shared by all 8, and 8 partial blocks
    # (7 copies made on write, the last writer keeping the original) against 8 x 3.
    assert runs["n=8"]["blocks_after_first_decode"] == 2 + 8
    assert runs["8 requests"]["blocks_after_first_decode"] == 8 * 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forks_under_preemption_and_aborts_keep_the_pool_consistent(tiny_qwen3_with_tokenizer, async_scheduling):
    llm = LLM(str(tiny_qwen3_with_tokenizer), num_kv_blocks=48, block_size=4, max_num_seqs=12,
              max_num_batched_tokens=40, async_scheduling=async_scheduling, record_trace=True)
    engine = llm.engine
    rng = random.Random(4)
    requests = {}
    for i in range(16):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(3, 30))]
        params = SamplingParams(n=rng.choice([1, 2, 3]), temperature=0.8, seed=i, max_tokens=rng.randint(2, 20),
                                ignore_eos=True)
        requests[engine.add_request(prompt, params, request_id=f"r{i}")] = (prompt, params)
    done, aborted = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        engine.block_manager.check_invariants(engine.scheduler.running)
        alive = sorted(set(engine.requests) - aborted)
        if alive and rng.random() < 0.1:
            victim = rng.choice(alive)
            engine.abort_request(victim)
            aborted.add(victim)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests
    assert any(r.preempted for r in engine.trace), "the pool never ran short: a weak test"
    # Every completed request's completions are what separate requests give.
    checked = 0
    for request_id, out in done.items():
        prompt, params = requests[request_id]
        if params.n == 1:
            continue
        separate = llm.generate([prompt] * params.n, [SamplingParams(temperature=0.8, seed=params.seed + i,
                                                                     max_tokens=params.max_tokens, ignore_eos=True)
                                                      for i in range(params.n)], use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in separate]
        checked += 1
    assert checked >= 3


def test_n_is_validated(llms, tmp_path):
    llm = llms[False]
    with pytest.raises(ValueError, match=r"\bn\b"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"\bn\b"):
        llm.generate([PROMPT], SamplingParams(n=10_000), use_tqdm=False)
    assert not llm.engine.requests


def test_hybrid_models_refuse_n(hybrid_checkpoint):
    llm = LLM(str(hybrid_checkpoint("qwen3_5")), num_kv_blocks=64, block_size=8)
    with pytest.raises(ValueError, match=r"\bn\b.*hybrid"):
        llm.generate([[5, 6, 7]], SamplingParams(n=2), use_tqdm=False)
