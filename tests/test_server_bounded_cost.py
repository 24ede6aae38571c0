"""What one request may cost the server: the findings of the re-audit, each a test.

A request's answer is bounded (log-probability entries) and written off the event loop; a
chat's structure (messages, parts, tools) is bounded before the models are built; one
client's grammars cannot hold every compile thread; the last inputs that got a 500 get a
400; a temperature or penalty at the edge of float32 never lets a banned token through;
a connection that never sends its request is closed; truncate_prompt_tokens rescues a
prompt longer than the context; the bundled chat template renders tools. The rule: refused
with a 4xx naming the parameter, or served correctly, and /health answers meanwhile.
"""
import asyncio
import json
import socket
import threading
import time

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

import minivllm
from minivllm import SamplingParams
from minivllm.server.api import ServerConfig, encode_json
from minivllm.server.grammar_gate import CompileGate
from minivllm.server.protocol import (MAX_CONTENT_PARTS, MAX_JSON_MEMBERS, MAX_MESSAGES, MAX_TOOLS, APIError,
                                      CompletionRequest, parse_request)
from minivllm.testing import torch_threads
from minivllm.tokenizer import encode_chat
from shared import SERVED_KEY, SERVED_MODEL, offline_engine, served_checkpoint, threaded_server

AUTH = {"Authorization": f"Bearer {SERVED_KEY}"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory, "bounded")


@pytest.fixture(scope="module")
def offline(checkpoint):
    with offline_engine(checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(checkpoint):
    with threaded_server(checkpoint, ServerConfig(api_key=SERVED_KEY, max_logprob_entries=50_000)) as running:
        yield running


def post(server, body, path="/v1/completions"):
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=120)
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


def error_of(response, status=400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# -- 1. what one answer may carry -------------------------------------------------------------


def test_too_many_logprob_entries_are_refused_before_any_work_naming_the_product(server):
    ids = list(range(3, 403))  # 48 prompts x 400 ids x (20 + 1), twice (echo and prompt_logprobs)
    start = time.perf_counter()
    error = error_of(post(server, {"prompt": [ids] * 48, "prompt_logprobs": 20, "echo": True, "logprobs": 20,
                                   "max_tokens": 1}))
    assert time.perf_counter() - start < 2
    assert error["param"] == "prompt_logprobs" and "50,000 (--max-logprob-entries)" in error["message"]
    assert "48 prompt(s) x n=1" in error["message"] and "19,200 prompt tokens" in error["message"]
    error = error_of(post(server, {"prompt": "hi", "n": 64, "logprobs": 20, "max_tokens": 40}))
    assert error["param"] == "logprobs" and "53,760" in error["message"] and "n=64" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 64, "logprobs": True, "top_logprobs": 20}
    assert error_of(post(server, chat, "/v1/chat/completions"))["param"] == "logprobs"  # no max_tokens: the context


def test_an_answer_under_the_budget_is_served_and_health_answers_meanwhile(server, offline):
    """lm-eval's loglikelihood shape (echo, logprobs 1, max_tokens 0) and n=8 with 5 logprobs."""
    answer = post(server, {"prompt": [list(range(3, 203))] * 4, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 4
    answer = post(server, {"prompt": "hi", "n": 8, "logprobs": 5, "max_tokens": 50, "temperature": 1, "seed": 1})
    assert answer.status_code == 200
    assert all(len(c["logprobs"]["top_logprobs"]) == 50 for c in answer.json()["choices"])


def test_the_chunked_json_is_the_json_module_s():
    value = {"a": [{"x": [1, 2.5, None]}, 3, "é\"\n"], "b": list(range(10_000)), "c": {}, "d": [[], [{}]],
             "e": [None, {"k": True}], "f": "text"}
    pieces = []
    encode_json(value, pieces)
    assert "".join(pieces) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# -- 2. a chat's structure ----------------------------------------------------------------------


@pytest.mark.slow
def test_half_a_million_empty_messages_are_refused_at_once(server):
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 500_000}).encode()
    for path in ("/v1/chat/completions", "/tokenize"):
        start = time.perf_counter()
        error = error_of(post(server, body, path))
        assert time.perf_counter() - start < 2, "refused while the body is counted, before the models are built"
        assert f"more than {MAX_JSON_MEMBERS} JSON objects and keys" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * (MAX_CONTENT_PARTS + 1)}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL] * (MAX_TOOLS + 1)}, "tools"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_messages_parts_and_tools_are_bounded_on_both_routes(server, body, param, path):
    assert error_of(post(server, body, path))["param"] == param


def test_a_tool_description_counts_towards_the_prompt(server):
    tool = {"type": "function", "function": {"name": "f", "description": "x" * 200_000}}
    for path in ("/v1/chat/completions", "/tokenize"):
        error = error_of(post(server, {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}, path))
        assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


def test_json_members_are_counted_only_in_big_bodies():
    small = json.dumps({"prompt": "hi", **{f"k{i}": 0 for i in range(1000)}}).encode()
    assert parse_request(small, CompletionRequest).prompt == "hi"
    big = json.dumps({"prompt": "hi", **{f"k{i}": 0 for i in range(MAX_JSON_MEMBERS)}}).encode()
    with pytest.raises(APIError, match="JSON objects and keys"):
        parse_request(big, CompletionRequest)
    with pytest.raises(APIError, match="not valid JSON"):  # (the model's parser says where)
        parse_request(b"{" + b" " * 300_000, CompletionRequest)


# -- 3. a fair share of the grammar compiler ----------------------------------------------------


def test_a_client_s_compiles_take_turns_and_others_pass():
    async def scenario():
        gate = CompileGate(per_client=1, wait_s=0.3)
        release = asyncio.Event()
        order = []

        async def slow():
            order.append("hostile starts")
            await release.wait()

        async def cheap():
            order.append("cheap")

        first = asyncio.create_task(gate.compile("10.0.0.2", slow))
        await asyncio.sleep(0)
        await gate.compile("10.0.0.3", cheap)  # another client: no wait
        with pytest.raises(APIError) as refused:
            await gate.compile("10.0.0.2", cheap)  # the same client: its turn does not come in time
        assert refused.value.status == 429 and refused.value.code == "grammar_queue_full"
        first.cancel()  # the client hangs up; its compile goes on and keeps its turn
        await asyncio.sleep(0)
        assert "10.0.0.2" in gate.turns
        release.set()
        await asyncio.sleep(0.01)
        assert gate.turns == {} and not gate.users
        return order

    assert asyncio.run(scenario()) == ["hostile starts", "cheap"]


# -- 4. every bad input a 400 ---------------------------------------------------------------------


@pytest.mark.parametrize("key", ["²", "①", "٣", "5" * 5000, "-1", "1.0", ""])
def test_logit_bias_keys_are_ascii_digits(server, key):
    assert error_of(post(server, {"prompt": "hi", "max_tokens": 2, "logit_bias": {key: 1}}))["param"] == "logit_bias"


def test_a_logit_bias_key_past_the_vocabulary_is_a_400(server):
    assert error_of(post(server, {"prompt": "hi", "max_tokens": 2, "logit_bias": {"9999999999": 1}}))["param"] == \
        "logit_bias"


def test_tokenize_renders_tools_through_the_template(server):
    answer = post(server, {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}, "/tokenize")
    assert answer.status_code == 200 and answer.json()["count"] > 0


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-z]+"}, "allowed_token_ids": [0, 1, 2]}, "allowed_token_ids"),
])
def test_a_grammar_that_admits_nothing_is_refused(server, fields, param):
    error = error_of(post(server, {"prompt": "hi", "max_tokens": 3, **fields}))
    assert error["param"] == param and ("admits no output" in error["message"] or "none of these" in error["message"])


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"regex": "ab"}, "allowed_token_ids": "a"},  # "a" allowed, "b" not: nothing after it
    {"structured_outputs": {"choice": ["a"]}, "bad_words": ["a"]},
])
def test_constraints_that_leave_nothing_later_are_the_client_s_400(server, fields):
    if fields.get("allowed_token_ids") == "a":
        fields = {**fields, "allowed_token_ids": [*server.engine.tokenizer.encode("a", add_special_tokens=False), 0]}
    error = error_of(post(server, {"prompt": "hi", "max_tokens": 4, "temperature": 0, **fields}))
    assert "nothing could be sampled" in error["message"]
    assert post(server, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_huge_temperature_with_a_grammar_is_served(server):
    answer = post(server, {"prompt": "hi", "max_tokens": 4, "temperature": 1e39,
                           "structured_outputs": {"regex": "[a-z]+"}})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"].isalpha()


def test_a_banned_token_is_never_drawn_at_the_edges_of_float32(offline):
    eos = offline.engine.eos_token_ids
    allowed = [5, 6, 7]
    cases = [SamplingParams(temperature=1e300, min_tokens=8, max_tokens=8, seed=s) for s in range(4)]
    cases += [SamplingParams(temperature=1e300, allowed_token_ids=allowed, max_tokens=8, seed=s) for s in range(4)]
    cases += [SamplingParams(temperature=1.0, repetition_penalty=1e-308, min_tokens=8, max_tokens=8, seed=s)
              for s in range(4)]
    cases += [SamplingParams(temperature=1e300, top_k=3, max_tokens=8, seed=1),
              SamplingParams(repetition_penalty=1e308, allowed_token_ids=allowed, max_tokens=8, seed=1)]
    with torch_threads(1):
        outs = offline.generate(["the the the"] * len(cases), cases, use_tqdm=False)
    for params, out in zip(cases, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 8 and out.outputs[0].finish_reason == "length", (params, tokens)
        if params.allowed_token_ids:
            assert set(tokens) <= set(allowed), (params, tokens)
        assert not set(tokens) & set(eos), (params, tokens)


def test_the_bounds_keep_float32_finite():
    assert SamplingParams(temperature=1e300).temperature == 1e30
    assert SamplingParams(repetition_penalty=1e-308).repetition_penalty == 1e-30
    assert SamplingParams(repetition_penalty=1e308).repetition_penalty == 1e30
    assert SamplingParams(temperature=0.7, repetition_penalty=1.3).temperature == 0.7


# -- 5. the rest ------------------------------------------------------------------------------------


def test_truncate_prompt_tokens_comes_before_the_length_check(server, offline):
    long = [(i % 200) + 3 for i in range(offline.engine.max_model_len + 50)]
    assert error_of(post(server, {"prompt": long, "max_tokens": 2}))["code"] == "context_length_exceeded"
    answer = post(server, {"prompt": long, "max_tokens": 2, "temperature": 0, "truncate_prompt_tokens": 20})
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 20
    with torch_threads(1):
        [expected] = offline.generate([long[-20:]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert answer.json()["choices"][0]["text"] == expected.outputs[0].text


@pytest.mark.slow
def test_a_connection_that_never_sends_its_request_is_closed(server):
    from minivllm.server import connections

    silent = socket.create_connection(("127.0.0.1", server.port))
    partial = socket.create_connection(("127.0.0.1", server.port))
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head never ends
    silent.settimeout(connections.HEAD_TIMEOUT_S + 10)
    partial.settimeout(connections.HEAD_TIMEOUT_S + 10)
    start = time.perf_counter()
    assert silent.recv(1) == b"" and partial.recv(1) == b"", "closed by the server"
    assert time.perf_counter() - start < connections.HEAD_TIMEOUT_S + 5
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_slow_answer_does_not_hold_health(server):
    """A big answer is built and written in worker threads: /health answers meanwhile."""
    worst, done = [0.0], threading.Event()

    def probe():
        while not done.is_set():
            start = time.perf_counter()
            httpx.get(server.url + "/health", timeout=30)
            worst[0] = max(worst[0], time.perf_counter() - start)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        answer = post(server, {"prompt": [list(range(3, 403))] * 5, "echo": True, "logprobs": 10, "max_tokens": 1})
    finally:
        done.set()
        thread.join()
    assert answer.status_code == 200 and worst[0] < 1.0


def test_the_bundled_template_renders_tools_and_calls_as_qwen3_does():
    tokenizer = AutoTokenizer.from_pretrained(Path(minivllm.__file__).parent / "assets" / "bundled")
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    calls = [*plain, {"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                       "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    _, text = encode_chat(tokenizer, calls, True, tools=[TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


# -- 6. the limits, where they are written ----------------------------------------------------------


def test_the_help_s_limits_table_says_the_server_s_numbers():
    from minivllm.cli import SERVE_LIMITS
    from minivllm.server import connections, grammar_gate
    from minivllm.structured import compiler

    config = ServerConfig()
    for number in (f"{MAX_JSON_MEMBERS:,}", f"{config.max_prompts}", f"{config.max_logprob_entries:,}",
                   f"{MAX_MESSAGES:,} per chat", f"{MAX_CONTENT_PARTS} parts", f"{MAX_TOOLS} per request",
                   f"{config.max_stop} of {config.max_stop_chars}", f"{compiler.COMPILE_TIMEOUT_S:g} s per spec",
                   f"{grammar_gate.COMPILE_WAIT_S:g} s at most", f"within {connections.HEAD_TIMEOUT_S:g} s",
                   f"{connections.KEEP_ALIVE_S:g} s idle"):
        assert number in SERVE_LIMITS, number
    assert config.max_request_bytes == 16 * 2**20 and "16 MiB" in SERVE_LIMITS
