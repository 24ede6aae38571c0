"""--reasoning-parser: a reasoning model's <think> text apart from its answer, as vLLM sends it
(``reasoning`` and ``reasoning_content``), whole and streamed, the tags split anywhere across
deltas; the prompt's own tags (a template that opens the reasoning, or closes it for
enable_thinking=false) set where the output starts."""
import json

import httpx
import openai
import pytest

from minivllm.server.api import ServerConfig
from minivllm.server.reasoning import REASONING_PARSERS, ReasoningAnswer, reasoning_parser
from shared import SERVED_KEY, SERVED_MODEL, served_checkpoint, threaded_server

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek_r1"]
OPEN_PROMPT = "<|im_start|>assistant\n"


@pytest.mark.parametrize("parser, prompt, text, reasoning, content", [
    (QWEN3, OPEN_PROMPT, "<think>\nhmm\n</think>\n\nYes.", "\nhmm\n", "\n\nYes."),
    (QWEN3, OPEN_PROMPT, "\n<think>a</think>b", "a", "b"),
    (QWEN3, OPEN_PROMPT, "Yes, <think> is a tag.", None, "Yes, <think> is a tag."),
    (QWEN3, OPEN_PROMPT, "<think>cut short", "cut short", ""),
    (QWEN3, OPEN_PROMPT, "<thin", None, "<thin"),
    (QWEN3, OPEN_PROMPT + "<think>\n", "hmm</think>Yes.", "hmm", "Yes."),  # the template opened it
    (QWEN3, OPEN_PROMPT + "<think>\n\n</think>\n\n", "<think>x</think>y", None, "<think>x</think>y"),  # closed
    (QWEN3, OPEN_PROMPT, "<think>a</think>b</think>c", "a", "b</think>c"),
    (R1, OPEN_PROMPT, "hmm</think>Yes.", "hmm", "Yes."),  # R1 may leave the opening tag out
    (R1, OPEN_PROMPT, "<think>hmm</think>Yes.", "hmm", "Yes."),
    (R1, OPEN_PROMPT, "still thinking", "still thinking", ""),
])
def test_split_whole(parser, prompt, text, reasoning, content):
    assert parser.split(prompt, text) == (reasoning, content)


@pytest.mark.parametrize("parser, prompt, text", [
    (QWEN3, OPEN_PROMPT, "<think>\nhmm, let me see\n</think>\n\nYes, <think> it is."),
    (QWEN3, OPEN_PROMPT, "  plain answer with < and </ in it"),
    (QWEN3, OPEN_PROMPT + "<think>\n", "a</thin b</think>c"),
    (R1, OPEN_PROMPT, "x</think/y</think>z<"),
])
def test_streamed_in_every_cut_equals_whole(parser, prompt, text):
    """Fed one character at a time, or in two pieces cut anywhere (through a tag too): the
    deltas add up to the whole split, and no tag's piece leaks into either side."""
    whole = parser.split(prompt, text)
    cuts = [list(range(1, len(text) + 1))] + [[k, len(text)] for k in range(1, len(text))]
    for ends in cuts:
        splitter, reasoning, content = parser.splitter(prompt), "", ""
        for end in ends:
            r, c = splitter.feed(text[:end], finished=end == len(text))
            reasoning, content = reasoning + r, content + c
        assert (splitter.reasoning_text(), content) == whole and reasoning == (whole[0] or "")


def test_a_stream_holds_back_only_what_could_be_a_tag():
    splitter = QWEN3.splitter(OPEN_PROMPT)
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("<think>ab</") == ("ab", "")
    assert splitter.feed("<think>ab</x") == ("</x", "")
    assert splitter.feed("<think>ab</x</think>ok") == ("", "ok")


def test_message_fields():
    answer = ReasoningAnswer(QWEN3, OPEN_PROMPT)
    assert answer.fields({"content": ""}, "r", stream=False) == {"content": None, "reasoning": "r",
                                                                 "reasoning_content": "r"}
    assert answer.fields({"content": "a"}, None, stream=False) == {"content": "a", "reasoning": None,
                                                                  "reasoning_content": None}
    assert answer.fields({"content": "a"}, "", stream=True) == {"content": "a"}
    assert answer.fields({"content": ""}, "r", stream=True) == {"reasoning": "r", "reasoning_content": "r"}


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        reasoning_parser("qwen")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="qwen")


# -- through the app ---------------------------------------------------------------------------

# Qwen3's generation prompt: an empty reasoning written by the template when thinking is off.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# The tiny model writes a reasoning only when a grammar makes it: the output is its pattern.
# (Its vocabulary spells the tags in several tokens, so a grammar holds from the first token;
# test_reasoning_grammar serves a model with the tags as tokens, its grammar after </think>.)
THINKS = {"regex": "<think>[a-z]{2,6}</think>[a-z]{2,6}"}
AUTH = {"Authorization": f"Bearer {SERVED_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = served_checkpoint(tmp_path_factory, "reasoning")
    config = ServerConfig(api_key=SERVED_KEY, reasoning_parser="qwen3", chat_template=THINKING_TEMPLATE)
    with threaded_server(checkpoint, config) as running:
        yield running


def chat(server, **fields):
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
            "temperature": 0, "structured_outputs": THINKS, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def test_reasoning_apart_from_content_whole_and_streamed(server):
    answer = chat(server).json()
    message = answer["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] and message["reasoning"].isalpha()
    thought = server.engine.tokenizer.encode(message["reasoning"], add_special_tokens=False)
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(thought)}
    assert message["content"].isalpha()
    reasoning = content = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
            "model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
            "temperature": 0, "structured_outputs": THINKS, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    assert delta.get("reasoning") == delta.get("reasoning_content")
                    reasoning += delta.get("reasoning") or ""
                    content += delta.get("content") or ""
    assert (reasoning, content) == (message["reasoning"], message["content"])


def test_enable_thinking_false_reaches_the_template(server):
    """The template closes the reasoning in the prompt: whatever the model writes is content."""
    message = chat(server, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"].startswith("<think>")


def test_the_openai_client_reads_the_reasoning(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=SERVED_KEY)
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=40, temperature=0, extra_body={"structured_outputs": THINKS})
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] and message.content
    stream = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=40, temperature=0, stream=True,
                                            extra_body={"structured_outputs": THINKS})
    chunks = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == \
        message.model_extra["reasoning_content"]
    assert "".join(d.content or "" for d in chunks) == message.content


# -- the Responses API: a reasoning item before the message --------------------------------


def test_response_items_reasoning_then_message():
    from minivllm.server.serving_responses import ResponseItems

    text = "<think>ab</think>cd"
    items = ResponseItems(None, QWEN3.splitter(OPEN_PROMPT))
    for end in range(1, len(text) + 1):
        items.update(text[:end], "stop" if end == len(text) else None)
    items.close("stop")
    reasoning, message = items.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "ab"}]
    assert message["content"][0]["text"] == "cd" and reasoning["status"] == message["status"] == "completed"
    kinds = [kind for kind, _ in items.events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


# A template that opens the reasoning itself (as Qwen3's thinking-only ones do): the tiny model
# never closes it, so all it writes is reasoning.
OPENING_TEMPLATE = THINKING_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}",
                                             "{{- '<|im_start|>assistant\\n<think>\\n' }}")


@pytest.fixture(scope="module")
def opening_server(tmp_path_factory):
    checkpoint = served_checkpoint(tmp_path_factory, "reasoning-open")
    config = ServerConfig(api_key=SERVED_KEY, reasoning_parser="qwen3", chat_template=OPENING_TEMPLATE)
    with threaded_server(checkpoint, config) as running:
        yield running


def test_responses_carry_a_reasoning_item(opening_server):
    client = openai.OpenAI(base_url=opening_server.url + "/v1", api_key=SERVED_KEY)
    chat_message = client.chat.completions.create(model=SERVED_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=8, temperature=0).choices[0].message
    assert chat_message.content is None and chat_message.model_extra["reasoning"]
    whole = client.responses.create(model=SERVED_MODEL, input="Hi", max_output_tokens=8, temperature=0)
    [item] = whole.output
    assert item.type == "reasoning" and item.content[0].text == chat_message.model_extra["reasoning"]
    assert whole.status == "incomplete" and whole.output_text == ""
    deltas, kinds = [], []
    with client.responses.stream(model=SERVED_MODEL, input="Hi", max_output_tokens=8, temperature=0) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.reasoning_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == item.content[0].text == final.output[0].content[0].text
    assert kinds[-3:] == ["response.reasoning_text.done", "response.output_item.done", "response.completed"]


def test_reasoning_sent_back_reaches_the_template_as_reasoning_content():
    """A client sends the assistant's reasoning back under either name; Qwen3's template reads
    it as reasoning_content (and ignored_fields no longer logs it)."""
    from minivllm.server.protocol import ChatCompletionRequest, ignored_fields, parse_request
    from minivllm.server.tools import template_messages

    for name in ("reasoning", "reasoning_content"):
        body = parse_request(json.dumps({"messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", name: "greet back"},
            {"role": "user", "content": "Bye"}]}).encode(), ChatCompletionRequest)
        assert ignored_fields(body) == []
        assert template_messages(body.messages)[1] == {"role": "assistant", "content": "Hello",
                                                       "reasoning_content": "greet back"}
