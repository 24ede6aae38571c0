"""SamplingParams.prompt_logprobs: the engine scores every prompt token after the first in its
normal prefill steps, and what it reports is what a full forward pass of transformers gives
(log_softmax of the logits at position p = the log-probability of prompt token p + 1): in
one step or across chunks, with asynchronous scheduling, after a preemption, and with the
prefix cache skipped for such a request. On the bundled model, in float32 on the CPU.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.engine import prompt_logprobs
from minivllm.llm import BUNDLED_MODEL
from minivllm.sampling_params import MAX_LOGPROBS, InvalidParameter

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["It is a truth universally acknowledged, that a single man in possession of a good fortune",
           "ROMEO:", "HAMLET:\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
           "Elizabeth"]
K = 4


@pytest.fixture(scope="module")
def reference():
    """log_softmax of transformers' logits at every position of a prompt."""
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()

    @torch.inference_mode()
    def logprobs(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return logprobs


def check(output, reference, k: int = K) -> None:
    """The output's prompt logprobs are the reference's: the prompt token's log-probability
    and rank at every position, and its k most likely tokens."""
    ids = output.prompt_token_ids
    scored = output.prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    ref = reference(ids)
    for p in range(1, len(ids)):
        entry, row, token = scored[p], ref[p - 1], ids[p]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4), p
        assert entry[token].rank == int((row > row[token]).sum()) + 1, p
        top = row.topk(k)
        got = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in got] == pytest.approx(top.values.tolist(), abs=1e-4), p
        assert {t for t, lp in entry.items() if lp.rank <= k} == set(top.indices.tolist()), p
        assert set(entry) <= set(top.indices.tolist()) | {token}  # nothing else
        assert entry[token].decoded_token is not None


def greedy(llm, prompts, **fields):
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K, **fields),
                        use_tqdm=False)


@pytest.mark.parametrize("engine_args", [
    dict(),  # each prompt in one step
    dict(max_num_batched_tokens=8),  # chunked: a prompt over several steps, a chunk of 8 at most
    dict(async_scheduling=True),
    dict(async_scheduling=True, max_num_batched_tokens=8),
], ids=["one-step", "chunked", "async", "async-chunked"])
def test_prompt_logprobs_are_a_full_forwards(reference, engine_args):
    llm = LLM(dtype="float32", num_kv_blocks=64, block_size=8, **engine_args)
    outputs = greedy(llm, PROMPTS)
    for output in outputs:
        check(output, reference)
    # The completion is untouched by the scoring beside it.
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_logits_of_a_chunk_are_computed_a_slice_at_a_time(reference, monkeypatch):
    """A chunk's prompt rows go through the LM head a slice at a time (here 3 rows), never
    all at once, and give the same scores."""
    llm = LLM(dtype="float32", num_kv_blocks=64, block_size=8)
    vocab = llm.engine.runner.model_config.vocab_size
    monkeypatch.setattr(prompt_logprobs, "PROMPT_LOGITS_ELEMENTS", 3 * vocab)
    model = llm.engine.runner.model
    rows_per_call = []
    compute_logits = model.compute_logits

    def counted(hidden, all_tokens=False):
        if all_tokens:
            rows_per_call.append(hidden.shape[0])
        return compute_logits(hidden, all_tokens)

    monkeypatch.setattr(model, "compute_logits", counted)
    [output] = greedy(llm, PROMPTS[:1])
    check(output, reference)
    assert max(rows_per_call) == 3 and sum(rows_per_call) == len(output.prompt_token_ids) - 1


def test_a_prefix_cache_hit_is_not_taken(reference):
    """A request that wants its prompt scored computes every prompt token (as in vLLM) even
    when the cache holds its prefix; its blocks still serve the requests after it."""
    llm = LLM(dtype="float32", num_kv_blocks=64, block_size=8)
    prompt = PROMPTS[2]
    [first] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    [scored] = greedy(llm, [prompt])
    [again] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert again.num_cached_tokens > 0 and scored.num_cached_tokens == 0
    check(scored, reference)
    assert scored.outputs[0].token_ids[:2] == first.outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preempted_request_keeps_its_scores(reference, monkeypatch, async_scheduling):
    """A pool too small for the batch preempts requests mid-prefill and mid-decode; each is
    recomputed, and its prompt is scored once, correctly."""
    # (A configuration found to preempt a request mid-prefill, both ways; the test checks it does.)
    llm = LLM(dtype="float32", num_kv_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
              async_scheduling=async_scheduling)
    preempted = []
    scheduler = llm.engine.scheduler
    preempt = scheduler._preempt

    def recorded(seq):
        preempted.append((seq.request_id, seq.num_computed_tokens < seq.num_prompt_tokens))
        preempt(seq)

    monkeypatch.setattr(scheduler, "_preempt", recorded)
    prompts = PROMPTS * 2
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=K),
                           use_tqdm=False)
    assert any(mid_prefill for _, mid_prefill in preempted), preempted  # the case worth checking
    for output in outputs:
        check(output, reference)
    plain = LLM(dtype="float32", num_kv_blocks=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


def test_n_completions_share_one_scoring_and_k_zero_gives_the_token_alone(reference):
    llm = LLM(dtype="float32", num_kv_blocks=64, block_size=8)
    [output] = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4,
                                                         prompt_logprobs=2), use_tqdm=False)
    assert len(output.outputs) == 3
    check(output, reference, k=2)
    [bare] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)
    check(bare, reference, k=0)
    assert all(list(entry) == [token] for entry, token in zip(bare.prompt_logprobs[1:], bare.prompt_token_ids[1:]))
    [one] = llm.generate([[7]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    assert one.prompt_logprobs == [None]  # a one-token prompt: nothing to score


def test_the_streamed_outputs_carry_the_whole_scoring_from_the_first():
    llm = LLM(dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request(llm.get_tokenizer().encode(PROMPTS[0], add_special_tokens=False),
                       SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1), "r", stream=True)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == 4
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outputs)


@pytest.mark.parametrize("value", [-2, MAX_LOGPROBS + 1, True, 2.0, "3"])
def test_a_bad_k_is_refused_by_name(value):
    with pytest.raises(InvalidParameter, match="prompt_logprobs") as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.param == "prompt_logprobs"
