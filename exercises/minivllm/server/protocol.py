# Exercise copy of minivllm/server/protocol.py, generated from it by scripts/make_exercises.py.
# Fill in: to_sampling_params (ch14).
# Grade: make grade CH=14
# Running the generator again overwrites this file: commit or copy your work first.

"""The OpenAI wire format: request bodies, their checks, and the JSON we answer with.

Requests are parsed strictly: a wrong type (``"max_tokens": "ten"``), an unknown field or a
value this server does not support (``n=2``) is a 400 naming the field, never a silent
default. The sampling fields map onto ``SamplingParams``, which checks the ranges. The
extensions vLLM accepts on top of OpenAI's fields (``top_k``, ``min_p``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``) are accepted here too.
"""
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import InvalidParameter, SamplingParams


class APIError(Exception):
    """An error the client caused (4xx) or one we did (5xx), in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- requests --------------------------------------------------------------------------


class Strict(BaseModel):
    # strict: no "10" for 10, no true for 1; forbid: a misspelt field is an error, not ignored;
    # no NaN or Infinity (JSON literals Python's parser takes, or 1e309) for a number.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """The fields both endpoints share."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n != 1:
            raise ValueError(f"n={n} is not supported: this server returns one choice per request")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value, info):
        if value not in (None, 0):
            raise ValueError(f"{info.field_name} is not supported (only 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[int]  # text, or token ids
    max_tokens: int | None = 16
    logprobs: int | None = None  # how many top log-probabilities per token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value):
        if value not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported")
        return value


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: until the context is full
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value


def parse_request(body: bytes, model: type[Strict]) -> Strict:
    """The body as ``model``, or an APIError(400) naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {error['msg']}") from None
        loc = [str(part) for part in error["loc"]]
        where = ".".join(loc) or "body"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = f"unknown field (accepted: {', '.join(sorted(model.model_fields))})"
        raise APIError(400, f"{where}: {message}", param=loc[0] if loc else None) from None


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """Map the request's sampling fields onto SamplingParams (which checks the ranges)."""
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        max_tokens, logprobs = request.max_tokens, request.logprobs
    try:
        raise NotImplementedError(
            "ch14: return SamplingParams from the request: temperature, top_p, top_k, min_p (a "
            "None field takes SamplingParams' default: 1.0, 1.0, 0, 0.0), seed, stop, "
            "stop_token_ids, ignore_eos, min_tokens, skip_special_tokens as they are, and the "
            "max_tokens and logprobs computed above, see notebooks/14_serving.ipynb"
        )
    except InvalidParameter as e:
        param = e.param
        if param == "logprobs" and isinstance(request, ChatCompletionRequest):
            param = "top_logprobs"
        raise APIError(400, str(e), param=param) from None


# -- responses -------------------------------------------------------------------------


def usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(completion: CompletionOutput, k: int, start: int = 0) -> dict | None:
    """Completions' logprobs object for tokens ``start:`` of the completion (the ``k`` most
    likely tokens at each step; ``text_offset`` counts characters from the completion's start)."""
    if completion.logprobs is None:
        return None
    pieces = [entry[t].decoded_token or "" for t, entry in zip(completion.token_ids, completion.logprobs)]
    offset = sum(map(len, pieces[:start]))
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry, piece in zip(completion.token_ids[start:], completion.logprobs[start:], pieces[start:]):
        tokens.append(piece)
        token_logprobs.append(entry[token_id].logprob)
        top.append({(lp.decoded_token or ""): lp.logprob for lp in _top(entry, k)})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(completion: CompletionOutput, k: int, start: int = 0) -> dict | None:
    """Chat's logprobs object (``content``: one entry per token) for tokens ``start:``."""
    if completion.logprobs is None:
        return None

    def item(text: str | None, logprob: float) -> dict:
        text = text or ""
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        chosen = entry[token_id]
        content.append({**item(chosen.decoded_token, chosen.logprob),
                        "top_logprobs": [item(lp.decoded_token, lp.logprob) for lp in _top(entry, k)]})
    return {"content": content}


def _top(entry: dict, k: int) -> list:
    """The k most likely tokens of a step, most likely first. (The engine also puts the
    chosen token in ``entry`` when it ranked below k; it is not one of the top k.)"""
    return sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)


def now() -> int:
    return int(time.time())
