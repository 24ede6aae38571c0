"""Structured output and tool calls through the server, with the official ``openai`` client,
on the bundled model (which knows no JSON and no tools: only the grammar makes its answers
valid). Every mode: response_format json_object / json_schema, vLLM's structured_outputs,
tools with tool_choice named, required and auto (the model's <tool_call> syntax parsed, and
streamed as tool-call deltas), tool results sent back through the chat template; and the
400s for what cannot work.
"""
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from minivllm import LLM
from minivllm.server import AsyncLLMEngine
from minivllm.server.api import ServerThread, build_app
from minivllm.server.tools import template_messages
from minivllm.structured.tools import HermesToolParser, Llama3JsonToolParser, complete_array_items
from minivllm.server.protocol import ChatCompletionRequest
from minivllm.testing import torch_threads
from minivllm.tokenizer import encode_chat
from shared import MESSAGES, SCHEMAS, TIME, TOOLS, WEATHER

MODEL = "bundled"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"],
}
SEEDS = range(6)


@pytest.fixture(scope="module")
def server():
    with torch_threads(1):
        engine = AsyncLLMEngine(LLM(num_kv_blocks=256, max_num_seqs=32).engine)
        with ServerThread(build_app(engine, MODEL)) as running:
            yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", MESSAGES),
                                          max_tokens=kwargs.pop("max_tokens", 200), **kwargs)


def test_response_format_json_schema(client):
    for seed in SEEDS:
        r = chat(client, seed=seed, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_the_clients_parse_helper_gets_its_pydantic_model(client):
    """What LangChain's with_structured_output does: a pydantic model as a strict json_schema."""
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        rainy: bool

    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City, max_tokens=100, seed=1)
    assert isinstance(r.choices[0].message.parsed, City)


def test_response_format_json_object_and_completions(client):
    r = chat(client, seed=2, max_tokens=60, response_format={"type": "json_object"})
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text.startswith("{")
    assert reason == "length" or isinstance(json.loads(text), dict)
    c = client.completions.create(model=MODEL, prompt="Data:", max_tokens=200, seed=3,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


@pytest.mark.parametrize("spec,check", [
    ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) or pytest.fail(t)),
    ({"choice": ["sunny", "rainy", "cloudy"]}, lambda t: t in ("sunny", "rainy", "cloudy") or pytest.fail(t)),
    ({"grammar": 'root ::= "forecast: " ("hot" | "cold") "!"'},
     lambda t: t in ("forecast: hot!", "forecast: cold!") or pytest.fail(t)),
])
def test_vllms_structured_outputs_field(client, spec, check):
    for seed in SEEDS[:3]:
        r = chat(client, seed=seed, extra_body={"structured_outputs": spec})
        check(r.choices[0].message.content)
        c = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=200, seed=seed,
                                      extra_body={"structured_outputs": spec})
        check(c.choices[0].text)


@pytest.mark.parametrize("fields,check", [
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"guided_json": json.dumps(PERSON), "guided_decoding_backend": "xgrammar"},
     lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) or pytest.fail(t)),
    ({"guided_choice": ["sunny", "rainy"], "guided_decoding_backend": "auto"},
     lambda t: t in ("sunny", "rainy") or pytest.fail(t)),
    ({"guided_grammar": 'root ::= "forecast: " ("hot" | "cold") "!"'},
     lambda t: t in ("forecast: hot!", "forecast: cold!") or pytest.fail(t)),
    # (any object: this model's strings can run on to max_tokens, so only its start is certain)
    ({"guided_json_object": True}, lambda t: t.startswith("{") or pytest.fail(t)),
])
def test_vllms_older_guided_fields(client, fields, check):
    """What clients written against vLLM before 0.12 send: each field is one of structured_outputs'."""
    for seed in SEEDS[:2]:
        r = chat(client, seed=seed, max_tokens=300, extra_body=fields)
        assert r.choices[0].finish_reason == "stop" or "guided_json_object" in fields
        check(r.choices[0].message.content)
        c = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=300, seed=seed, extra_body=fields)
        check(c.choices[0].text)


def test_n_completions_each_follow_the_schema(client):
    r = chat(client, n=3, seed=4, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert len(r.choices) == 3
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_a_streamed_constrained_answer_follows_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    for seed in SEEDS[:3]:
        chunks = list(chat(client, seed=seed, stream=True, response_format=fmt))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert len([p for p in pieces if p]) > 3  # streamed, not sent whole at the end
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        jsonschema.validate(json.loads("".join(pieces)), PERSON)
        # The same tokens as the answer sent whole.
        assert "".join(pieces) == chat(client, seed=seed, response_format=fmt).choices[0].message.content


def test_max_tokens_ends_a_constrained_answer_as_length(client):
    r = chat(client, max_tokens=4, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_named_tool_choice(client):
    for seed in SEEDS:
        r = chat(client, seed=seed, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None  # (vLLM's, for a named call)
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_choice(client):
    names = set()
    for seed in SEEDS[:3]:
        # (This model rarely closes the array before the grammar's limit of 8 calls.)
        r = chat(client, seed=seed, tools=TOOLS, tool_choice="required", max_tokens=600)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and 1 <= len(choice.message.tool_calls) <= 8
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            names.add(call.function.name)
    assert names  # at least one tool chosen (which: the model's choice)


def test_required_without_parallel_calls_makes_one(client):
    for seed in SEEDS[:3]:
        r = chat(client, seed=seed, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        assert len(r.choices[0].message.tool_calls) == 1


def stream_tool_calls(stream):
    """Reassemble a streamed answer: content, {index: [id, name, arguments]}, finish_reason."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", "", ""])
            if tc.id:
                entry[0] = tc.id
            if tc.function and tc.function.name:
                entry[1] += tc.function.name
            if tc.function and tc.function.arguments:
                entry[2] += tc.function.arguments
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def test_named_tool_choice_streams_argument_deltas(client):
    stream = chat(client, seed=7, stream=True, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    content, calls, reason = stream_tool_calls(stream)
    assert reason == "stop" and content == ""  # (vLLM's, for a named call)
    [(call_id, name, arguments)] = calls.values()
    assert call_id.startswith("call_") and name == "get_time"
    jsonschema.validate(json.loads(arguments), TIME)


# The bundled model never writes a tool call on its own: a regex makes it write Hermes' syntax,
# and tool_choice=auto must find the call in the text.
FORCED_CALL = {"regex": r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", '
                        r'"unit": "celsius"\}\}\n</tool_call>'}


def test_auto_parses_the_models_tool_call_syntax(client):
    r = chat(client, seed=1, tools=TOOLS, tool_choice="auto", extra_body={"structured_outputs": FORCED_CALL})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # Without tools the same text is just text.
    plain = chat(client, seed=1, extra_body={"structured_outputs": FORCED_CALL})
    assert plain.choices[0].finish_reason == "stop" and "<tool_call>" in plain.choices[0].message.content


def test_auto_streams_content_then_tool_call_deltas(client):
    content, calls, reason = stream_tool_calls(chat(client, seed=1, stream=True, tools=TOOLS,
                                                    extra_body={"structured_outputs": FORCED_CALL}))
    assert reason == "tool_calls" and content.strip() == "Let me check." and "<tool" not in content
    [(_, name, arguments)] = calls.values()
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_auto_without_a_call_is_plain_text(client):
    r = chat(client, seed=0, max_tokens=20, tools=TOOLS, tool_choice="auto")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_tool_results_go_back_through_the_template(client, server):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = chat(client, messages=messages, tools=TOOLS, max_tokens=10, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": rendered}).json()["prompt"]
    # As Qwen3's template renders them: the call in the assistant's turn, its result in a user's.
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees and sunny\n</tool_response><|im_end|>" in text
    with_tools = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": with_tools}).json()["prompt"]
    assert "<tools>" in text and '"name": "get_weather"' in text, "the tools reach the prompt"


def test_a_template_that_renders_tools_sees_the_calls_as_objects():
    """Qwen's and Hermes' templates read tools and an assistant's tool_calls (arguments as an
    object): a small template of that kind, rendered as the server renders requests."""
    template = ("{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}"
                "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }};"
                "{% endfor %}{% endfor %}")
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo <|im_end|>"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}], "tools": TOOLS})
    tokenizer = LLM().get_tokenizer()
    ids, text = encode_chat(tokenizer, template_messages(body.messages), False, chat_template=template,
                            tools=[t.model_dump(exclude_none=True) for t in body.tools])
    assert text == "TOOL get_weather;TOOL get_time;[user]hi[assistant]CALL get_weather Oslo <|im_end|>;[tool]cold"
    assert 2 not in ids  # the <|im_end|> a client wrote in the arguments is text, not the control token


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", 'Unsupported type "strin"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "unsupported JSON schema feature"),
    ({"response_format": {"type": "json_schema"}}, None, "json_schema is given with type 'json_schema'"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid regular expression"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "invalid EBNF grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "give exactly one of"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "cannot be combined with response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "no tool is named 'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "function names must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tool_choice", "unsupported JSON schema feature"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"guided_json": PERSON, "structured_outputs": {"json": PERSON}}, "guided_json",
     "guided_json: cannot be combined with structured_outputs (one constraint per request; guided_json is vLLM's "
     "older name for structured_outputs.json)"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "guided_choice: cannot be combined with "
     "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_grammar": 'root ::= "a"'}, "guided_grammar",
     "cannot be combined with response_format"),
    ({"guided_regex": "(ab"}, "guided_regex", "guided_regex: SamplingParams.structured_outputs.regex: invalid "
     "regular expression"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "unsupported JSON schema feature"),
    ({"guided_choice": []}, "guided_choice", "choice must be a list of 1 to"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "this server's grammar engine is xgrammar"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar:disable-additional-properties"},
     "guided_decoding_backend", "got 'xgrammar:disable-additional-properties'"),
    ({"guided_json": PERSON, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "structured_outputs.whitespace_pattern: not supported by this server"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag: not supported"),
])
def test_what_cannot_work_is_a_400_naming_it(server, body, param, message):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param, error


# -- the parsers on their own ------------------------------------------------------------


def test_hermes_parser_streams_content_and_whole_calls():
    parser = HermesToolParser()
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    seen_content = ""
    for end in range(len(text) + 1):
        content, calls, _ = parser.split(text[:end], finished=False)
        assert content.startswith(seen_content)  # what was sent is never taken back
        assert "<" not in content.replace("Sure. ", "")
        seen_content = content
    content, calls, rest = parser.split(text, finished=True)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert content.strip() == "Sure." and rest == ""


def test_hermes_parser_keeps_what_is_not_a_call():
    parser = HermesToolParser()
    content, calls, _ = parser.split("a <tool_call>not json</tool_call> b <tool_c", finished=True)
    assert calls == [] and content == "a <tool_call>not json</tool_call> b <tool_c"
    content, calls, _ = parser.split("x <tool_call>{\"name\": \"f\"", finished=True)  # never closed
    assert calls == [] and content == "x <tool_call>{\"name\": \"f\""


def test_llama3_json_parser():
    parser = Llama3JsonToolParser()
    content, calls, _ = parser.split('{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}', True)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 2}), ("g", {})]
    assert parser.split("Hello there", True)[:2] == ("Hello there", [])
    assert parser.split('{"name": "f", "param', False)[:2] == ("", [])  # undecided until it ends


def test_complete_array_items():
    assert complete_array_items('[{"a": 1}, {"b": [2, 3]}, {"c"') == [{"a": 1}, {"b": [2, 3]}]
    assert complete_array_items("") == [] and complete_array_items("[") == []
