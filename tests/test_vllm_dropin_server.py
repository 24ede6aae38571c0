"""A vLLM user's command line and client against ``minivllm serve``: vLLM's flags parse (or are
refused by name), several served names are aliases, /v1/models cards carry root and parent, and
--max-logprobs -1 lets a request ask for the whole vocabulary within the server's entry budget."""
import logging

import httpx
import pytest

from minivllm.cli import build_parser, checked_engine_args, main, parse_args, server_config
from minivllm.server.api import ServerConfig
from shared import SERVED_KEY, SERVED_MODEL, served_checkpoint, threaded_server

AUTH = {"Authorization": f"Bearer {SERVED_KEY}"}
# vLLM's quick-start and tool-calling command line for Qwen3, pointed at a local folder.
VLLM_LINE = ["serve", "some/model", "-tp", "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--reasoning-parser", "qwen3", "--trust-remote-code", "--disable-log-requests", "--disable-log-stats", "--enable-chunked-prefill",
             "--max-logprobs", "-1", "--seed", "7", "--uvicorn-log-level", "warning", "--kv-cache-dtype", "auto",
             "--quantization", "none", "--served-model-name", "qwen", "qwen3", "--allowed-origins", '["*"]',
             "--generation-config", "vllm", "--max-model-len", "256", "--gpu-memory-utilization", "0.8",
             "--swap-space", "4"]


def test_a_vllm_command_line_parses(caplog):
    args = parse_args(build_parser(), VLLM_LINE)
    assert args.model == "some/model" and args.tensor_parallel_size == 1 and args.seed == 7
    assert args.served_model_name == ["qwen", "qwen3"]
    assert args.disable_log_requests and args.uvicorn_log_level == "warning"
    config = server_config(args)
    assert config.allowed_origins == ["*"] and config.max_logprobs == -1
    assert config.model_aliases == ["qwen3"] and config.model_root == "some/model"
    assert config.reasoning_parser == "qwen3"
    with caplog.at_level(logging.INFO, logger="minivllm.engine.engine_args"):
        given = checked_engine_args(args)
    assert given == {"tensor_parallel_size": 1, "seed": 7, "generation_config": "vllm", "max_model_len": 256,
                     "gpu_memory_utilization": 0.8, "kv_cache_dtype": "auto", "quantization": "none"}
    for name in ("trust_remote_code", "enable_auto_tool_choice", "disable_log_stats", "swap_space"):
        assert f"{name} accepted" in caplog.text


def test_comma_separated_origins_still_work():
    args = parse_args(build_parser(), ["serve", "--allowed-origins", "http://a, http://b"])
    assert server_config(args).allowed_origins == ["http://a", "http://b"]


@pytest.mark.parametrize("flags, words", [
    (["--enable-lora"], ["enable_lora", "LoRA"]),
    (["-pp", "2"], ["pipeline_parallel_size", "tensor_parallel_size"]),
    (["--limit-mm-per-prompt", '{"image": 1}'], ["limit_mm_per_prompt", "text models only"]),
    (["--kv-cache-dtype", "fp8_e5m2"], ["kv_cache_dtype", "must be one of"]),
    (["--quantization", "awq"], ["quantization", "not supported yet"]),
    (["--reasoning-parser", "qwen"], ["--reasoning-parser", "qwen3", "deepseek_r1"]),
    (["--max-num-seqz", "4", "--enable-prefix-cashing"], ["did you mean --max-num-seqs?",
                                                         "did you mean --enable-prefix-caching?"]),
    (["--max-logprobs", "50"], ["max_logprobs=50"]),
])
def test_out_of_scope_flags_and_typos_are_refused_by_name(flags, words, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", "1", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    for word in words:
        assert word in err


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = served_checkpoint(tmp_path_factory, "dropin")
    config = ServerConfig(api_key=SERVED_KEY, max_logprobs=-1, model_aliases=["alias"], model_root=str(checkpoint),
                          max_logprob_entries=50_000)
    with threaded_server(checkpoint, config) as running:
        running.checkpoint = checkpoint
        yield running


def post(server, path, body):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)


def test_model_cards_carry_root_and_parent_and_aliases(server):
    cards = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert [c["id"] for c in cards] == [SERVED_MODEL, "alias"]
    assert all(c["root"] == str(server.checkpoint) and c["parent"] is None for c in cards)
    assert httpx.get(server.url + "/v1/models/alias", headers=AUTH).json()["id"] == "alias"
    answer = post(server, "/v1/completions", {"model": "alias", "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == SERVED_MODEL  # the first name is reported
    assert post(server, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}).status_code == 404


def test_whole_vocabulary_logprobs_within_the_entry_budget(server):
    vocab = server.engine.vocab_size
    got = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": -1, "temperature": 0})
    assert got.status_code == 200, got.text
    # (keyed by token text: tokens that decode alike share a key)
    assert all(20 < len(top) <= vocab for top in got.json()["choices"][0]["logprobs"]["top_logprobs"])
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "logprobs": True, "top_logprobs": -1})
    assert chat.status_code == 200, chat.text
    assert all(len(t["top_logprobs"]) == vocab for t in chat.json()["choices"][0]["logprobs"]["content"])
    too_many = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 200, "logprobs": -1})
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "too_many_logprobs"


def test_whole_vocabulary_needs_the_flag(tmp_path_factory):
    checkpoint = served_checkpoint(tmp_path_factory, "dropin-default")
    with threaded_server(checkpoint) as running:
        got = post(running, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": -1})
        chat = post(running, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "logprobs": True, "top_logprobs": -1})
    assert got.status_code == 400 and got.json()["error"]["param"] == "logprobs"
    assert "--max-logprobs" in got.json()["error"]["message"]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"


def events(response) -> list:
    import json

    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_return_token_ids(server):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    streamed = events(post(server, "/v1/completions", {**body, "stream": True}))
    assert whole["prompt_token_ids"] and len(whole["token_ids"]) == 4
    assert streamed[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for e in streamed for c in e["choices"] for t in c["token_ids"]] == whole["token_ids"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    answer = post(server, "/v1/chat/completions", chat).json()
    assert answer["prompt_token_ids"] and len(answer["choices"][0]["token_ids"]) == 4
    chunks = events(post(server, "/v1/chat/completions", {**chat, "stream": True}))
    assert chunks[0]["choices"][0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert [t for e in chunks[1:] for c in e["choices"] for t in c.get("token_ids", [])] == \
        answer["choices"][0]["token_ids"]
    plain = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_return_tokens_as_token_ids(server):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"][1:] for key in top)
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                 "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
                                                 "return_tokens_as_token_ids": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


def test_the_role_chunk_leaves_with_the_first_token(server, monkeypatch):
    """The chat stream's first chunk (the role) waits for the prefill: a client timing its
    first token from the first chunk (vLLM's benchmark does) measures the real one."""
    import time

    engine = server.engine
    generate = engine.generate
    delay = 0.5

    async def slow_prefill(*args, **kwargs):
        import asyncio

        await asyncio.sleep(delay)
        async for output in generate(*args, **kwargs):
            yield output

    monkeypatch.setattr(engine, "generate", slow_prefill)
    start = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as r:
        first_line = next(line for line in r.iter_lines() if line.startswith("data: "))
        waited = time.monotonic() - start
    assert '"role": "assistant"' in first_line and waited >= delay


def test_continuous_usage_stats(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": options, "return_token_ids": True}))
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    sent = 0
    for chunk in chunks[1:-1]:  # each: the tokens up to and including its own
        sent += len(chunk["choices"][0]["token_ids"])
        assert chunk["usage"]["completion_tokens"] == sent
        assert chunk["usage"]["total_tokens"] == prompt_tokens + sent
    batch = events(post(server, "/v1/completions", {"prompt": ["Hello", "The quick brown fox"], "max_tokens": 3,
                                                    "stream": True, "stream_options": options}))
    assert all("usage" in c for c in batch)
    plain = events(post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True,
                                                    "stream_options": {"include_usage": True}}))
    assert [("usage" in c) for c in plain] == [False] * (len(plain) - 1) + [True]


def test_chat_echo_puts_the_assistants_last_message_first(server):
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 4, "temperature": 0}
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Well," + plain
    chunks = events(post(server, "/v1/chat/completions", {**body, "echo": True, "stream": True}))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == echoed
    user_last = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    assert post(server, "/v1/chat/completions", {**user_last, "echo": True}).json()["choices"][0]["message"][
        "content"] == post(server, "/v1/chat/completions", user_last).json()["choices"][0]["message"]["content"]


def test_the_bundled_models_root_is_its_folder():
    from minivllm.engine.engine_args import BUNDLED_MODEL

    assert server_config(parse_args(build_parser(), ["serve"])).model_root == str(BUNDLED_MODEL)


def test_an_image_or_audio_part_is_refused_as_such(server):
    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}):
        got = post(server, "/v1/chat/completions", {"model": SERVED_MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]})
        assert got.status_code == 400 and got.json()["error"]["param"] == "messages"
        assert f"a {part['type']!r} part: this server serves text models only" in got.json()["error"]["message"]


def test_json_object_with_a_value_schema_applies_it(server):
    """huggingface_hub's InferenceClient sends Text Generation Inference's form."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
              "additionalProperties": False}
    got = post(server, "/v1/chat/completions", {
        "model": SERVED_MODEL, "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 40,
        "temperature": 0, "response_format": {"type": "json_object", "value": schema}}).json()
    jsonschema.validate(json.loads(got["choices"][0]["message"]["content"]), schema)
    refused = post(server, "/v1/chat/completions", {
        "model": SERVED_MODEL, "messages": [{"role": "user", "content": "Where?"}],
        "response_format": {"type": "text", "value": schema}})
    assert refused.status_code == 400 and "value" in refused.json()["error"]["message"]
