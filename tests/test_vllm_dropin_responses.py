"""POST /v1/responses (OpenAI's Responses API) for text, through the openai SDK as a user calls
it: a string or a message list, instructions, max_output_tokens, plain and streamed; the text is
the chat route's for the same conversation."""
import httpx
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
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": "hi", "model": "other"}, "model"),
])
def test_refused_with_a_reason(server, body, param):
    got = httpx.post(server.url + "/v1/responses", json=body, headers=AUTH, timeout=60)
    assert got.status_code in (400, 404), got.text
    assert got.json()["error"]["param"] == param


def test_text_format_json_schema(client):
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    got = client.responses.create(model=SERVED_MODEL, input="Where?", max_output_tokens=40, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                                   "strict": True}})
    assert got.status == "completed"
    assert set(json.loads(got.output_text)) == {"city"}
