"""The server's serving classes, each built alone and called directly, with no HTTP and no
model: a stand-in engine client (the bundled tokenizer, and a ``generate`` that answers with
fixed tokens) shows what each class hands the engine and what it answers, and that a bad
request is refused before the engine sees it."""
import asyncio
import json

import pytest

from minivllm.engine.engine_args import BUNDLED_MODEL
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, parse_request)
from minivllm.server.serving_chat import OpenAIServingChat
from minivllm.server.serving_completions import OpenAIServingCompletion
from minivllm.server.serving_engine import ServerConfig
from minivllm.server.serving_models import OpenAIServingModels
from minivllm.server.serving_tokenize import OpenAIServingTokenization
from minivllm.server.streaming import EventStream
from minivllm.tokenizer import encode_chat, load_tokenizer
from starlette.requests import Request

MODEL = "stand-in"
ANSWER = [260, 8078, 917]  # "hello world" in the bundled tokenizer: every completion says it


class StandInEngine:
    """What a serving class reads of an engine client, with no engine behind it: each
    request's completion is ANSWER, one token per output, then finished by length."""

    def __init__(self, tokenizer, max_model_len: int = 64, defaults: dict | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.default_sampling_fields = defaults or {}
        self.requests: list[tuple] = []  # (prompt ids, SamplingParams, request id, text), as generate got them

    def validate(self, prompt_token_ids, sampling_params) -> None:
        if any(t >= self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"token ids must be below {self.vocab_size}")

    async def compile_grammar(self, sampling_params) -> None:
        return None

    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt):
        self.requests.append((prompt_token_ids, sampling_params, request_id, prompt))
        for n in range(1, len(ANSWER) + 1):
            done = n == len(ANSWER)
            completion = CompletionOutput(index=0, text=self.tokenizer.decode(ANSWER[:n]), token_ids=ANSWER[:n],
                                          finish_reason="length" if done else None)
            yield RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                outputs=[completion], finished=done)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_MODEL)


@pytest.fixture
def engine(tokenizer):
    return StandInEngine(tokenizer, defaults={"temperature": 0.5})


def http_request(body: dict | None = None, content_type: str = "application/json") -> Request:
    """A Starlette request as a route hands it on, made without a server: its body, and a
    client that never disconnects."""
    data = json.dumps(body or {}).encode()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.sleep(3600)  # still connected

    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(data)).encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                    "query_string": b""}, receive)


def parse(request_class, /, **fields):
    return parse_request(json.dumps(fields).encode(), request_class)


def generation(cls, engine):
    return cls(engine, MODEL, ServerConfig(), ServerMetrics(engine, MODEL))


def test_a_completion_hands_the_engine_the_prompt_and_answers_its_tokens(engine, tokenizer):
    serving = generation(OpenAIServingCompletion, engine)
    request = http_request()
    answer = asyncio.run(serving.create_completion(parse(CompletionRequest, model=MODEL, prompt="hello world",
                                                         max_tokens=3), request))
    [(ids, params, request_id, text)] = engine.requests
    assert ids == tokenizer.encode("hello world", add_special_tokens=False) and text == "hello world"
    assert params.temperature == 0.5, "a field the request leaves out takes the checkpoint's default"
    assert params.max_tokens == 3
    assert request.state.request_id == request_id == answer["id"] and request_id.startswith("cmpl-")
    assert answer["choices"] == [{"index": 0, "text": tokenizer.decode(ANSWER), "logprobs": None,
                                  "finish_reason": "length", "stop_reason": None}]
    assert answer["usage"]["prompt_tokens"] == len(ids) and answer["usage"]["completion_tokens"] == len(ANSWER)


def test_a_batch_of_prompts_gets_a_choice_each_under_ids_of_their_own(engine):
    serving = generation(OpenAIServingCompletion, engine)
    answer = asyncio.run(serving.create_completion(parse(CompletionRequest, prompt=["a b", "c d"], echo=True),
                                                   http_request()))
    assert [r[2] for r in engine.requests] == [answer["id"] + "-0", answer["id"] + "-1"]
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["choices"][0]["text"].startswith("a b"), "echo puts the prompt before the completion"


def test_a_streamed_completion_is_its_events_then_done(engine, tokenizer):
    serving = generation(OpenAIServingCompletion, engine)
    body = parse(CompletionRequest, prompt="hi", stream=True, stream_options={"include_usage": True})
    stream = asyncio.run(serving.create_completion(body, http_request()))
    assert isinstance(stream, EventStream)

    async def events():
        return [event async for event in stream.body_iterator]

    raw = "".join(asyncio.run(events()))
    assert raw.endswith("data: [DONE]\n\n")
    chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n")[:-2]]
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == tokenizer.decode(ANSWER)
    assert chunks[-1]["usage"]["completion_tokens"] == len(ANSWER)


@pytest.mark.parametrize("fields, status, param", [
    ({"model": "another", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi", "stop": ["x"] * 65}, 400, "stop"),
    ({"prompt": list(range(64))}, 400, "prompt"),  # as long as the context
    ({"prompt": "hi", "max_tokens": 64}, 400, "max_tokens"),
    ({"prompt": [1, 99999]}, 400, "prompt"),  # the engine's own check
])
def test_a_bad_completion_is_refused_before_the_engine_sees_it(engine, fields, status, param):
    serving = generation(OpenAIServingCompletion, engine)
    with pytest.raises(APIError) as e:
        asyncio.run(serving.create_completion(parse(CompletionRequest, **fields), http_request()))
    assert (e.value.status, e.value.param) == (status, param)
    assert engine.requests == []


def test_a_chat_goes_through_the_template(engine, tokenizer):
    serving = generation(OpenAIServingChat, engine)
    messages = [{"role": "user", "content": "hello"}]
    answer = asyncio.run(serving.create_chat_completion(parse(ChatCompletionRequest, messages=messages),
                                                        http_request()))
    [(ids, _, request_id, text)] = engine.requests
    assert (ids, text) == encode_chat(tokenizer, messages)
    assert request_id.startswith("chatcmpl-") and "hello" in text
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": tokenizer.decode(ANSWER)}


def test_a_chat_template_of_the_request_is_refused_unless_trusted(engine):
    serving = generation(OpenAIServingChat, engine)
    body = parse(ChatCompletionRequest, messages=[{"role": "user", "content": "hi"}], chat_template="{{ 1 }}")
    with pytest.raises(APIError, match="--trust-request-chat-template") as e:
        asyncio.run(serving.create_chat_completion(body, http_request()))
    assert e.value.param == "chat_template" and engine.requests == []


def test_tokenize_and_detokenize_round_trip(engine, tokenizer):
    serving = OpenAIServingTokenization(engine, MODEL, ServerConfig())
    tokens = asyncio.run(serving.tokenize(parse(TokenizeRequest, prompt="hello world", return_token_strs=True)))
    assert tokens["tokens"] == ANSWER and tokens["count"] == 3 and tokens["max_model_len"] == engine.max_model_len
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(ANSWER)
    assert asyncio.run(serving.detokenize(parse(DetokenizeRequest, tokens=ANSWER))) == {"prompt": "hello world"}
    with pytest.raises(APIError, match=r"each must be in \[0, 8192\)"):
        asyncio.run(serving.detokenize(parse(DetokenizeRequest, tokens=[8192])))


def test_the_models_are_the_one_served(engine):
    serving = OpenAIServingModels(engine, MODEL, ServerConfig())
    listed = serving.show_available_models()
    assert [m["id"] for m in listed["data"]] == [MODEL] and listed["data"][0]["max_model_len"] == 64
    assert serving.show_model(MODEL)["id"] == MODEL
    with pytest.raises(APIError) as e:
        serving.show_model("another")
    assert (e.value.status, e.value.code) == (404, "model_not_found")


def test_a_body_is_read_only_as_json_within_the_limit(engine):
    serving = OpenAIServingTokenization(engine, MODEL, ServerConfig(max_request_bytes=64))
    body = asyncio.run(serving.read_request(http_request({"prompt": "hi"}), TokenizeRequest))
    assert body.prompt == "hi"
    with pytest.raises(APIError) as e:
        asyncio.run(serving.read_request(http_request({"prompt": "hi"}, content_type="text/plain"), TokenizeRequest))
    assert e.value.status == 415
    with pytest.raises(APIError) as e:
        asyncio.run(serving.read_request(http_request({"prompt": "x" * 100}), TokenizeRequest))
    assert e.value.status == 413
