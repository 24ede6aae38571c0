"""POST /v1/responses (OpenAI's Responses API) through the openai SDK as a user calls it: a
string or a message list, instructions, max_output_tokens, plain and streamed; the text is the
chat route's for the same conversation; function tools (named, required, auto) answered as
function_call items, whole and streamed in their events, and sent back as input."""
import json

import httpx
import jsonschema
import openai
import pytest

from minivllm.server.api import ServerConfig
from shared import SERVED_KEY, SERVED_MODEL, served_checkpoint, threaded_server

AUTH = {"Authorization": f"Bearer {SERVED_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with threaded_server(served_checkpoint(tmp_path_factory, "responses"), ServerConfig(api_key=SERVED_KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=SERVED_KEY, max_retries=0, timeout=60)


def chat_text(client, messages, max_tokens):
    answer = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=max_tokens,
                                            temperature=0)
    return answer.choices[0].message.content, answer.choices[0].finish_reason


def test_text_input_with_instructions(client):
    got = client.responses.create(model=SERVED_MODEL, input="Tell me a story", instructions="Be brief",
                                  max_output_tokens=6, temperature=0)
    want, reason = chat_text(client, [{"role": "system", "content": "Be brief"},
                                      {"role": "user", "content": "Tell me a story"}], 6)
    assert got.output_text == want
    assert got.status == ("incomplete" if reason == "length" else "completed")
    assert got.usage.output_tokens <= 6 and got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
    assert got.output[0].role == "assistant" and got.instructions == "Be brief"


def test_message_list_input(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "input_text", "text": "How are you?"}]}]
    got = client.responses.create(model=SERVED_MODEL, input=messages, max_output_tokens=5, temperature=0)
    want, _ = chat_text(client, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                 {"role": "user", "content": "How are you?"}], 5)
    assert got.output_text == want


def test_streamed(client):
    kinds, deltas, final = [], [], None
    with client.responses.stream(model=SERVED_MODEL, input="Tell me a story", max_output_tokens=6,
                                 temperature=0) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    whole = client.responses.create(model=SERVED_MODEL, input="Tell me a story", max_output_tokens=6, temperature=0)
    assert "".join(deltas) == whole.output_text == final.output_text
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == "response.completed" and final.status == whole.status


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"},
      "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"input": "hi", "model": "other"}, "model"),
])
def test_refused_with_a_reason(server, body, param):
    got = httpx.post(server.url + "/v1/responses", json=body, headers=AUTH, timeout=60)
    assert got.status_code in (400, 404), got.text
    assert got.json()["error"]["param"] == param


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    got = client.responses.create(model=SERVED_MODEL, input="Where?", max_output_tokens=40, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                   "strict": True}})
    assert got.status == "completed"
    assert set(json.loads(got.output_text)) == {"city"}


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]


def test_named_tool_choice_is_a_function_call_item(client):
    got = client.responses.create(model=SERVED_MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0,
                                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    assert got.status == "completed" and got.output_text == ""
    [call] = got.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert got.tool_choice.name == "get_weather" and [t.name for t in got.tools] == ["get_weather", "get_time"]


def test_required_tool_choice(client):
    got = client.responses.create(model=SERVED_MODEL, input="Anything?", tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    assert got.status == "completed"
    [call] = got.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")


def test_function_call_events_streamed(client):
    kinds, deltas = [], []
    with client.responses.stream(model=SERVED_MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=60) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.function_call_arguments.delta":
                deltas.append(ev.delta)
            if ev.type == "response.function_call_arguments.done":
                done = ev.arguments
        final = stream.get_final_response()
    whole = client.responses.create(model=SERVED_MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    assert "".join(deltas) == done == final.output[0].arguments == whole.output[0].arguments
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert final.output[0].type == "function_call" and final.output[0].status == "completed"


def test_a_call_and_its_output_sent_back(client):
    """The SDK's round trip: the first response's output items, then the call's output, as the
    next input; the prompt is chat's for the same conversation."""
    first = client.responses.create(model=SERVED_MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    call = first.output[0]
    items = [{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump() for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    got = client.responses.create(model=SERVED_MODEL, input=items, tools=TOOLS, max_output_tokens=5, temperature=0)
    want = client.chat.completions.create(
        model=SERVED_MODEL, max_tokens=5, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                      "name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.output_text == (want.choices[0].message.content or "")


def test_auto_tool_calls_become_items_as_the_text_grows():
    """tool_choice=auto: the model's own <tool_call> syntax, read as chat reads it; the text
    before the call is a message item, closed when the call begins."""
    from minivllm.server.serving_responses import ResponseItems
    from minivllm.server.tools import ToolAnswer
    from minivllm.structured.tools import tool_plan

    plan = tool_plan([{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}], "auto")
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    items = ResponseItems(ToolAnswer(plan, "hermes"))
    for end in range(1, len(text) + 1):
        items.update(text[:end], "stop" if end == len(text) else None)
    items.close("stop")
    message, call = items.items
    assert message["type"] == "message" and message["content"][0]["text"].strip() == "Let me check."
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Oslo"}
    kinds = [kind for kind, _ in items.events]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_item.added", 1)
    assert kinds[-1] == "response.output_item.done" and call["status"] == "completed"
