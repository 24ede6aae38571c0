"""What a vLLM user copies works here: vLLM's keywords of ``LLM(...)`` and ``SamplingParams``,
its prompt types, ``llm.llm_engine`` and ``RequestOutput.metrics``; the flags of ``vllm serve``
(tests/test_vllm_dropin_server.py has the server's side). Each keyword is either honoured,
accepted with a notice where it changes nothing here, or refused with a message naming it."""
import logging

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.engine_args import create_engine_config
from minivllm.inputs import TextPrompt, TokensPrompt
from minivllm.sampling_params import InvalidParameter, RequestOutputKind, resolve_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_with_tokenizer):
    return LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=128, block_size=8, max_logprobs=-1,
               trust_remote_code=True, seed=0, enable_chunked_prefill=True, disable_log_stats=True,
               tokenizer=str(tiny_qwen3_with_tokenizer), quantization=None, kv_cache_dtype="auto")


def test_vllm_keywords_are_accepted(llm, caplog):
    assert llm.llm_engine is llm.engine
    assert llm.max_logprobs == -1


@pytest.mark.parametrize("kwargs, words", [
    (dict(enable_lora=True), ["enable_lora", "LoRA"]),
    (dict(pipeline_parallel_size=2), ["pipeline_parallel_size", "tensor_parallel_size"]),
    (dict(limit_mm_per_prompt={"image": 1}), ["limit_mm_per_prompt", "text"]),
    (dict(quantization="awq"), ["quantization", "not supported yet"]),
    (dict(kv_cache_dtype="fp8_e5m2"), ["kv_cache_dtype", "must be one of"]),
    (dict(tokenizer="/somewhere/else"), ["tokenizer", "model's own folder"]),
    (dict(revision="main"), ["revision", "local folder"]),
    (dict(max_num_seq=4), ["max_num_seq", "did you mean 'max_num_seqs'"]),
    (dict(trust_remote_cod=True), ["did you mean 'trust_remote_code'"]),
])
def test_out_of_scope_keywords_and_typos_are_refused(tiny_qwen3_with_tokenizer, kwargs, words):
    with pytest.raises(ValueError) as e:
        create_engine_config(str(tiny_qwen3_with_tokenizer), device="cpu", **kwargs)
    for word in words:
        assert word in str(e.value)


def test_accepted_keyword_says_why_it_changes_nothing(tiny_qwen3_with_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="minivllm.engine.engine_args"):
        create_engine_config(str(tiny_qwen3_with_tokenizer), device="cpu", trust_remote_code=True, swap_space=4)
    assert "trust_remote_code accepted" in caplog.text and "no code from a checkpoint" in caplog.text
    assert "swap_space accepted" in caplog.text


def test_max_logprobs_is_checked(tiny_qwen3_with_tokenizer):
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=16, max_logprobs=21)


def test_prompt_types_are_vllms(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello there", add_special_tokens=False)
    a, b = llm.generate([TextPrompt(prompt="Hello there"), TokensPrompt(prompt_token_ids=ids)], GREEDY,
                        use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt == "Hello there" and b.prompt is None
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": None}}, GREEDY, use_tqdm=False)


def test_whole_vocabulary_logprobs(llm):
    vocab = llm.engine.limits.vocab_size
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    [out] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert all(len(entry) == vocab for entry in out.outputs[0].logprobs)
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])
    [top] = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=3),
                         use_tqdm=False)
    assert out.outputs[0].token_ids == top.outputs[0].token_ids
    assert out.outputs[0].cumulative_logprob == pytest.approx(top.outputs[0].cumulative_logprob)


@pytest.mark.parametrize("fields", [dict(temperature=0), dict(temperature=0.8, seed=5, top_k=20),
                                    dict(temperature=0, logit_bias={7: 3.0}, min_tokens=3)])
def test_cumulative_logprob_without_logprobs(llm, fields):
    """As vLLM's V1 engine fills it: None unless logprobs were asked for (the sampler then
    makes no pass over the vocabulary for them); with logprobs=0, the sum of the sampled
    tokens' log-probabilities (the model's, before any processing)."""
    params = SamplingParams(max_tokens=5, ignore_eos=True, **fields)
    [plain] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    [scored] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0, **fields),
                            use_tqdm=False)
    plain, scored = plain.outputs[0], scored.outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None and plain.token_ids == scored.token_ids
    total = sum(entry[t].logprob for t, entry in zip(scored.token_ids, scored.logprobs))
    assert scored.cumulative_logprob == pytest.approx(total, abs=1e-4) and scored.cumulative_logprob < 0


def test_whole_vocabulary_needs_max_logprobs_minus_one():
    params = SamplingParams(logprobs=-1)
    with pytest.raises(InvalidParameter, match="max_logprobs") as e:
        resolve_logprobs(params, 100)
    assert e.value.param == "logprobs"
    assert resolve_logprobs(params, 100, max_logprobs=-1).logprobs == 100
    assert params.logprobs == -1  # the caller's params are left as they were
    with pytest.raises(InvalidParameter, match="prompt_logprobs"):
        resolve_logprobs(SamplingParams(prompt_logprobs=5), 100, max_logprobs=4)


def test_sampling_params_vllm_fields(llm):
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, extra_args={"x": 1},
                            spaces_between_special_tokens=False)
    assert params.output_kind == RequestOutputKind.FINAL_ONLY and params.extra_args == {"x": 1}
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    [plain, raw] = llm.generate([[5, 6, 7]] * 2, [GREEDY, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                          detokenize=False)], use_tqdm=False)
    assert raw.outputs[0].token_ids == plain.outputs[0].token_ids
    assert raw.outputs[0].text == "" and plain.outputs[0].text
    for kwargs, name in [(dict(detokenize=False, stop=["x"]), "stop"), (dict(output_kind=7), "output_kind"),
                         (dict(extra_args=[1]), "extra_args"), (dict(detokenize=1), "detokenize")]:
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(**kwargs)
        assert e.value.param == name


def test_request_metrics_mark_each_stage_in_order(llm):
    outputs = llm.generate([[5, 6, 7, 8] * 4, [9, 10]], SamplingParams(temperature=0.8, max_tokens=5, n=2,
                                                                       ignore_eos=True), use_tqdm=False)
    for out in outputs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.time_in_queue == m.first_scheduled_time - m.arrival_time


def test_request_metrics_while_streaming(llm):
    request_id = llm.engine.add_request([5, 6, 7], GREEDY, stream=True)
    seen = []
    while not seen or not seen[-1].finished:
        seen += [o for o in llm.engine.step() if o.request_id == request_id]
    assert seen[0].metrics.first_token_time == seen[-1].metrics.first_token_time
    assert seen[0].metrics.last_token_time < seen[-1].metrics.last_token_time


def test_seed_none_is_the_engines_default(tiny_qwen3_with_tokenizer):
    config = create_engine_config(str(tiny_qwen3_with_tokenizer), device="cpu", seed=None)
    assert config.seed == 0


def test_a_sampling_params_typo_names_the_field():
    with pytest.raises(TypeError, match="'max_token' \\(did you mean 'max_tokens'\\?\\)"):
        SamplingParams(max_token=5)
    with pytest.raises(TypeError, match="'frobnicate'"):
        SamplingParams(frobnicate=1)
