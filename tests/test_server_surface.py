"""What clients send (issue 18): the request surface of vLLM's and OpenAI's servers.

Unknown fields are ignored with a warning; batched prompts get a choice each; the chat
template's options reach the template; the tokenizer routes, /version, /metrics and the
X-Request-Id header answer as vLLM's do; the checkpoint's generation_config.json gives the
defaults; the command line makes a flag of every EngineConfig field; a SentencePiece
completion keeps its leading space.
"""
import json
import logging

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.server import AsyncLLMEngine
from minivllm.server.api import ServerConfig, ServerThread, build_app
from minivllm.testing import make_tiny_checkpoint, torch_threads
from minivllm.tokenizer import IncrementalDetokenizer, encode_chat
from shared import SERVED_ENGINE, SERVED_KEY, SERVED_MODEL, offline_engine, served_checkpoint, threaded_server

MODEL, KEY, ENGINE = SERVED_MODEL, SERVED_KEY, SERVED_ENGINE
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The quick brown fox", "Hello, world! How are", "Prefix caching lets requests", "It was the best of"]
# A template with a variable of its own, to see chat_template_kwargs arrive.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if shout %}SHOUT{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory, "surface")


@pytest.fixture(scope="module")
def offline(checkpoint):
    with offline_engine(checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(checkpoint):
    with threaded_server(checkpoint, ServerConfig(api_key=KEY, max_prompts=8)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy(offline, prompts, **fields):
    with torch_threads(1):
        return offline.generate(prompts, SamplingParams(temperature=0, **fields), use_tqdm=False)


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, headers={**AUTH, **kwargs.pop("headers", {})}, timeout=60,
                      **kwargs)


# -- 1. unknown fields ---------------------------------------------------------------------


def test_unknown_fields_are_ignored_with_a_warning(server, client, offline, caplog):
    [want] = greedy(offline, [PROMPTS[0]], max_tokens=6)
    with caplog.at_level(logging.WARNING, logger="minivllm.server.api"):
        got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                        extra_body={"temprature": 3, "priority": 1})
        chat = post(server, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi", "refusal": None}],
            "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}})
    assert got.choices[0].text == want.outputs[0].text
    assert chat.status_code == 200
    assert "temprature" in caplog.text and "priority" in caplog.text
    assert "messages.0.refusal" in caplog.text and "stream_options.include_obfuscation" in caplog.text
    # Types stay strict for the fields it knows.
    bad = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "6"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


# -- 2. batched prompts ---------------------------------------------------------------------


def test_a_batch_of_strings_or_token_lists_gets_a_choice_per_prompt(client, offline):
    want = greedy(offline, PROMPTS, max_tokens=8)
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    ids = [w.prompt_token_ids for w in want]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [w.outputs[0].text for w in want]


def test_a_streamed_batch_carries_each_prompts_index(client, offline):
    want = greedy(offline, PROMPTS, max_tokens=8)
    texts = [""] * len(PROMPTS)
    finish = [None] * len(PROMPTS)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [w.outputs[0].text for w in want]
    assert finish == [w.outputs[0].finish_reason for w in want]
    assert chunks[-1].usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)


def test_a_batch_is_bounded_and_checked_whole_before_any_runs(server):
    too_many = post(server, "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 9})
    assert too_many.status_code == 400 and "--max-prompts" in too_many.json()["error"]["message"]
    one_bad = post(server, "/v1/completions", {"model": MODEL, "prompt": ["hi", "fox " * 600]})
    error = one_bad.json()["error"]
    assert one_bad.status_code == 400 and error["param"] == "prompt"
    assert not server.engine.engine.has_unfinished_requests()


# -- 3. chat ---------------------------------------------------------------------------------


def test_chat_options_reach_the_template(server, client, offline):
    tokenizer = offline.get_tokenizer()
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
                    {"role": "assistant", "content": None}, {"role": "user", "content": "How are you?"}]
    flat = [{"role": "user", "content": "Hello, world"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "How are you?"}]
    with torch_threads(1):
        [want] = offline.chat(conversation, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert want.prompt_token_ids == encode_chat(tokenizer, flat)[0]
    # No model named: the served one.
    got = post(server, "/v1/chat/completions", {"messages": conversation, "max_tokens": 6, "temperature": 0})
    assert got.status_code == 200, got.text
    assert got.json()["model"] == MODEL and got.json()["choices"][0]["message"]["content"] == want.outputs[0].text

    # continue_final_message: the assistant's message is carried on, not closed.
    partial = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The quick"}]
    ids, text = encode_chat(tokenizer, partial, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("The quick")
    got = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=4, temperature=0,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert got.usage.prompt_tokens == len(ids)
    closed, _ = encode_chat(tokenizer, partial, add_generation_prompt=False)
    assert post(server, "/tokenize", {"messages": partial, "add_generation_prompt": False}).json()["tokens"] == closed


def test_chat_template_flag_and_its_kwargs(checkpoint, offline):
    with torch_threads(1):
        engine = AsyncLLMEngine(LLM(str(checkpoint), **ENGINE).engine)
        with ServerThread(build_app(engine, MODEL, config=ServerConfig(chat_template=TEMPLATE))) as s:
            messages = [{"role": "user", "content": "hi"}]
            plain = httpx.post(s.url + "/tokenize", json={"messages": messages}).json()
            loud = httpx.post(s.url + "/tokenize", json={"messages": messages,
                                                          "chat_template_kwargs": {"shout": True}}).json()
            tokenizer = offline.get_tokenizer()
            assert plain["tokens"] == encode_chat(tokenizer, messages, chat_template=TEMPLATE)[0]
            assert tokenizer.decode(loud["tokens"]).endswith("SHOUT<|im_start|>assistant\n")
            got = httpx.post(s.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                                    "chat_template_kwargs": {"shout": True}})
            assert got.status_code == 200 and got.json()["usage"]["prompt_tokens"] == loud["count"]
    with torch_threads(1):  # offline, the same options
        [out] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False,
                             chat_template=TEMPLATE, chat_template_kwargs={"shout": True})
    assert out.prompt_token_ids == loud["tokens"]


# -- 4. endpoints ----------------------------------------------------------------------------


def test_tokenize_detokenize_version_and_the_model_card(server, offline):
    tokenizer = offline.get_tokenizer()
    got = post(server, "/tokenize", {"prompt": PROMPTS[0], "return_token_strs": True}).json()
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 512
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": PROMPTS[0]}
    for body, param in (({"tokens": [5, 10**6]}, "tokens"), ({"tokens": [5] * 513}, "tokens"),
                        ({"tokens": "5"}, "tokens")):
        response = post(server, "/detokenize", body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    for body in ({}, {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}):
        response = post(server, "/tokenize", body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert httpx.get(server.url + "/version", headers=AUTH).json()["version"]
    card = httpx.get(server.url + f"/v1/models/{MODEL}", headers=AUTH).json()
    assert card["id"] == MODEL and card["max_model_len"] == 512
    missing = httpx.get(server.url + "/v1/models/gpt-9", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_the_key_guards_everything_but_health_and_metrics(server):
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                         ("GET", f"/v1/models/{MODEL}")):
        response = httpx.request(method, server.url + path, json={"tokens": [5]})
        assert response.status_code == 401, path
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_count_what_was_served(server, client):
    before = httpx.get(server.url + "/metrics").text
    long_prompt = " ".join(PROMPTS * 3)
    first = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    second = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    # The second asks for what the first left in the prefix cache.
    assert second.usage.prompt_tokens_details.cached_tokens >= 8
    page = httpx.get(server.url + "/metrics")
    assert page.headers["content-type"].startswith("text/plain")

    def value(text, name, labels=""):
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    text = page.text
    label = f'model_name="{MODEL}"'
    assert value(text, "vllm:request_success_total", 'finished_reason="length"') \
        - value(before, "vllm:request_success_total", 'finished_reason="length"') == 2
    assert value(text, "vllm:generation_tokens_total", label) - value(before, "vllm:generation_tokens_total", label) == 10
    assert value(text, "vllm:prompt_tokens_total", label) - value(before, "vllm:prompt_tokens_total", label) \
        == 2 * first.usage.prompt_tokens
    assert value(text, "vllm:prefix_cache_hits_total", label) >= second.usage.prompt_tokens_details.cached_tokens
    assert value(text, "vllm:time_to_first_token_seconds_count", label) >= 2
    assert value(text, "vllm:inter_token_latency_seconds_count", label) >= 8
    assert 0 < value(text, "vllm:prefix_cache_hit_rate", label) <= 1
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"{gauge}{{{label}}}" in text, gauge


def test_x_request_id(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    mine = post(server, "/v1/completions", body, headers={"X-Request-Id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    generated = post(server, "/v1/completions", body)
    assert generated.headers["x-request-id"] == generated.json()["id"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
        first = json.loads(next(r.iter_lines())[len("data: "):])
        assert r.headers["x-request-id"] == first["id"]
    assert httpx.get(server.url + "/health").headers["x-request-id"]
    too_long = post(server, "/v1/completions", body, headers={"X-Request-Id": "x" * 129})
    assert too_long.status_code == 400 and "X-Request-Id" in too_long.json()["error"]["message"]


# -- 5. defaults from generation_config.json -------------------------------------------------


def test_generation_config_gives_the_defaults(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "greedy", family="qwen3", seed=3, with_tokenizer=True)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 7,
                                                             "top_p": 0.5, "min_p": 0.1}))
    with torch_threads(1):
        llm = LLM(str(path), **ENGINE)
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.0, 7, 0.5, 0.1)
        assert LLM(str(path), generation_config="vllm", **ENGINE).get_default_sampling_params().temperature == 1.0
        [default] = llm.generate([PROMPTS[0]], use_tqdm=False)  # temperature 0 from the file: greedy
        [want] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        assert default.outputs[0].token_ids == want.outputs[0].token_ids
        engine = AsyncLLMEngine(LLM(str(path), **ENGINE).engine)
        with ServerThread(build_app(engine, MODEL)) as s:
            got = [httpx.post(s.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16}).json()
                   for _ in range(2)]
    # Left out, temperature comes from the file: greedy, so the same text twice.
    assert got[0]["choices"][0]["text"] == got[1]["choices"][0]["text"] == want.outputs[0].text


# -- 6. the command line ---------------------------------------------------------------------


def test_the_command_line_makes_a_flag_of_every_engine_field():
    from minivllm.cli import build_parser, engine_args, engine_fields, parse_args

    parser = build_parser()
    args = parse_args(parser, ["serve", "some/model", "--max-num-seqs", "0", "--no-enable-prefix-caching",
                               "--async-scheduling", "--seed", "0", "--tensor-parallel-size", "2"])
    assert args.model == "some/model"
    assert engine_args(args) == {"max_num_seqs": 0, "enable_prefix_caching": False, "async_scheduling": True,
                                 "seed": 0, "tensor_parallel_size": 2}
    assert parse_args(parser, ["serve", "--model", "m"]).model == "m"
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for f in engine_fields():
        assert "--" + f.name.replace("_", "-") in help_text, f.name
    with pytest.raises(SystemExit):
        parse_args(parser, ["serve", "a", "--model", "b"])


def test_a_zero_is_refused_by_the_engine_not_dropped(capsys):
    from minivllm.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--max-num-seqs", "0", "--port", "1"])
    assert exited.value.code == 2 and "max_num_seqs=0" in capsys.readouterr().err


# -- 7. bugs ---------------------------------------------------------------------------------


def test_max_model_len_past_the_model_is_an_error(checkpoint):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(checkpoint), max_model_len=10**6, **ENGINE)


def metaspace_tokenizer():
    """A small SentencePiece-style (Metaspace) tokenizer, built here: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["Hello", "world", "how", "are", "you", "to", "day"]
    vocab = {"<unk>": 0, "</s>": 1, **{f"\u2581{w}": i + 2 for i, w in enumerate(words)},
             "day": len(words) + 2}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix=""))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def test_a_metaspace_completion_keeps_its_leading_space():
    tokenizer = metaspace_tokenizer()
    ids = tokenizer.encode("Hello world how are you today", add_special_tokens=False)
    assert tokenizer.decode(ids[1:2]) == "world"  # alone, SentencePiece drops the space: the bug's cause
    prompt, completion = ids[:1], ids[1:]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    text = "".join(detokenizer.step(completion[:i + 1]) for i in range(len(completion)))
    assert text == " world how are you today"
    assert tokenizer.decode(prompt) + text == tokenizer.decode(ids)


# -- n completions and the sampling extensions, served ------------------------------------


def test_n_completions_through_the_openai_client(server, offline, client):
    """n choices per prompt, in OpenAI's order (prompt by prompt), each what the offline
    engine gives for that completion, plain and streamed; usage counts every completion."""
    prompts = ["The quick brown fox", "It was the best of"]
    fields = dict(temperature=1.0, seed=5, max_tokens=8, extra_body={"ignore_eos": True})
    got = client.completions.create(model=MODEL, prompt=prompts, n=3, **fields)
    with torch_threads(1):
        want = offline.generate(prompts, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [c.text for o in want for c in o.outputs]
    assert got.usage.completion_tokens == 6 * 8
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=3, stream=True, **fields):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(6)] == [c.text for c in got.choices]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], n=2,
                                          temperature=0, max_tokens=6)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same twice


def test_penalties_and_logit_bias_reach_the_engine(server, offline, client):
    body = dict(temperature=0, max_tokens=10, extra_body={"ignore_eos": True, "repetition_penalty": 1.3,
                                                          "bad_words": ["the"]},
                presence_penalty=0.5, frequency_penalty=0.2)
    got = client.completions.create(model=MODEL, prompt="The quick brown fox", **body)
    with torch_threads(1):
        [want] = offline.generate(["The quick brown fox"], SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3, bad_words=["the"],
            presence_penalty=0.5, frequency_penalty=0.2), use_tqdm=False)
    assert got.choices[0].text == want.outputs[0].text
    # A bias of +100 on one token makes greedy decoding pick it every time.
    biased = client.completions.create(model=MODEL, prompt="The quick brown fox", temperature=0, max_tokens=4,
                                       logit_bias={"42": 100}, logprobs=0)
    assert set(biased.choices[0].logprobs.tokens) == {offline.get_tokenizer().decode([42])}


def test_responses_are_valid_openai_types(server):
    """Every response shape, raw off the wire, validates as the openai package's own types
    (strictly: pydantic's validation of the required fields and their types)."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.completion import Completion as CompletionChunk  # streamed completions share the type

    def post(path, body):
        r = httpx.post(server.url + path, json={"model": MODEL, **body}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r

    def events(path, body):
        with httpx.stream("POST", server.url + path, json={"model": MODEL, "stream": True, **body}, headers=AUTH,
                          timeout=60) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    completion = {"prompt": ["The quick brown fox", "It was"], "n": 2, "max_tokens": 5, "logprobs": 2,
                  "temperature": 0.7, "seed": 1}
    chat = {"messages": [{"role": "user", "content": "Hello"}], "n": 2, "max_tokens": 5, "logprobs": True,
            "top_logprobs": 2, "temperature": 0.7, "seed": 1}
    parsed = Completion.model_validate(post("/v1/completions", completion).json())
    assert len(parsed.choices) == 4 and parsed.usage.completion_tokens == 20
    ChatCompletion.model_validate(post("/v1/chat/completions", chat).json())
    chunks = events("/v1/completions", {**completion, "stream_options": {"include_usage": True}})
    # (The package's Completion type has no null finish_reason, which OpenAI's own streams
    # send mid-stream too: only the chunks that end choices, and the usage chunk, validate.)
    final = [c for c in chunks if all(choice["finish_reason"] for choice in c["choices"])]
    assert len(final) >= 2 and all(CompletionChunk.model_validate(c) for c in final)
    chat_chunks = events("/v1/chat/completions", chat)
    assert chat_chunks and all(ChatCompletionChunk.model_validate(c) for c in chat_chunks)


def test_bench_serving_measures_a_running_server(server, tmp_path):
    """``minivllm bench serving --base-url``: the benchmark against a server it did not start."""
    from minivllm.cli import main

    main(["bench", "serving", "--base-url", server.url, "--api-key", KEY, "--vocab", "512", "--rates", "inf",
          "--num-requests", "6", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "serving_external.json").read_text())
    [run] = report["online"]
    assert report["model"] == MODEL and run["num_errors"] == 0 and run["requests"] == 6
    assert run["output_tokens_per_s"] > 0 and run["ttft_s"]["p50"] is not None


def test_percentiles_are_numpys():
    import numpy as np

    from minivllm.bench.serving import percentiles

    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.05]
    got = percentiles(values, ps=(0, 50, 90, 99, 100))
    assert list(got.values()) == pytest.approx(list(np.percentile(values, [0, 50, 90, 99, 100])))
