# Reference copy of minivllm/server/protocol.py, generated from it by scripts/make_exercises.py.
# Reference answers for: to_sampling_params (ch14).
# Do not edit: change minivllm/server/protocol.py and run scripts/make_exercises.py again.

"""The OpenAI wire format: request bodies, their checks, and the JSON we answer with.

Known fields are parsed strictly: a wrong type (``"max_tokens": "ten"``) or a value this
server does not support (``best_of=2``, ``echo``) is a 400 naming the field, never a silent
default. A field it does not know at all is accepted and ignored, with a warning in the log
that names it, as vLLM does: clients send the fields of newer API versions and of other
servers, and refusing them would break those clients for nothing. (The price: a misspelt
field is ignored too, which is why the warning names it.) The sampling fields map onto
``SamplingParams``, which checks the ranges. The extensions vLLM accepts on top of OpenAI's
fields (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``chat_template_kwargs``...) are accepted here too.
"""
import dataclasses
import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import InvalidParameter, SamplingParams
from minivllm.structured import StructuredOutputsParams


# Bounds on a body's structure, checked while it is parsed: its cost grows with the number of
# objects in it, not with its bytes (500,000 empty messages fit in 15 MB), so each list a
# client may make long is bounded, and the body's JSON objects and keys are counted first.
MAX_MESSAGES = 4096  # messages per chat (or /tokenize) request: long agent conversations stay well under
MAX_CONTENT_PARTS = 256  # text parts per message
MAX_TOOLS = 128  # tools per request, and tool calls per assistant message
MAX_JSON_MEMBERS = 100_000  # JSON objects and keys per body, all levels together
# Bodies below this many bytes cannot hold MAX_JSON_MEMBERS: they go straight to the parser.
PRESCAN_BYTES = 256 * 2**10


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


class Lenient(Strict):
    """A request body, or a part of one: the fields it declares are as strict as ``Strict``'s,
    and any other field is kept aside (``model_extra``) to be named in a warning and ignored."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(Lenient):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far, not only the last one.
    continuous_usage_stats: bool = False


class SamplingFields(Lenient):
    """The fields both endpoints share."""

    model: str | None = None  # None: the model this server serves
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

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return value

    # vLLM's sampling extensions beyond OpenAI's (SamplingParams checks their ranges)
    repetition_penalty: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    # vLLM's: the answer carries the token ids (each choice's, and the prompt's), and a
    # logprobs entry names its token "token_id:<id>" rather than by its text (which may not
    # be valid UTF-8 alone).
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # Score the prompt: each prompt token's log-probability and the top k, in a
    # "prompt_logprobs" list (on each choice of a completion, on a chat response).
    prompt_logprobs: int | None = None

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        # As in vLLM: a stream's chunks have no place for them. (vLLM lets 0 through and
        # sends nothing; here any value is refused rather than dropped.)
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        """JSON object keys are strings: they must spell token ids."""
        # ASCII digits only: str.isdigit() passes "²" and "٣", which int() refuses or reads
        # as 3; and ten at most, so that int() never meets a 5,000-digit key.
        if value is not None and not all(k.isascii() and k.isdigit() and len(k) <= 10 for k in value):
            raise ValueError("keys must be token ids written as decimal strings of ASCII digits (\"50256\")")
        return value


class StructuredFields(Lenient):
    """What the output must follow (chapter 18): OpenAI's ``response_format``, or vLLM's own
    ``structured_outputs`` (StructuredOutputsParams' fields), or one of vLLM's older ``guided_*``
    fields. At most one of them."""

    response_format: "ResponseFormat | None" = None
    structured_outputs: "StructuredOutputsField | None" = None
    # vLLM's names before structured_outputs (deprecated in vLLM 0.10.2, removed in 0.12): each
    # is one field of structured_outputs (server.tools.LEGACY_FIELDS), kept for the clients
    # written against those versions.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    guided_decoding_backend: str | None = None  # which grammar engine: this server has one, xgrammar

    @field_validator("guided_decoding_backend")
    @classmethod
    def _our_backend(cls, value):
        if value is None:
            return value
        name, _, options = value.partition(":")
        # vLLM's options that change nothing here: this server never falls back to another
        # engine, and its JSON has no free whitespace already.
        unknown = [o for o in options.split(",") if o and o not in ("no-fallback", "disable-any-whitespace")]
        if name not in ("auto", "xgrammar") or unknown:
            raise ValueError(f"this server's grammar engine is xgrammar: 'auto' or 'xgrammar' (with the options "
                             f"no-fallback, disable-any-whitespace), got {value!r}")
        return value


class CompletionRequest(SamplingFields, StructuredFields):
    # text, or token ids; or a batch of either: one choice per prompt, in order
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = None  # how many top log-probabilities per token
    # The prompt's text before the completion's, and with logprobs the prompt tokens' first
    # (the first token's is null: nothing precedes it). What lm-eval's loglikelihood sends.
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

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


    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or the batch it lists."""
        p = self.prompt
        return p if p and isinstance(p, list) and not isinstance(p[0], int) else [p]


class TextPart(Lenient):
    type: Literal["text"]  # an image or audio part is refused by name: this server reads text only
    text: str


def text_parts_only(data, text_types: tuple[str, ...]):
    """A message's content parts, checked before they are parsed: an image, audio, video or
    file part is refused as what it is (this server serves text models), rather than with
    the parser's word that the content is not a string."""
    content = data.get("content") if isinstance(data, dict) else None
    for j, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in text_types:
            allowed = " or ".join(repr(t) for t in text_types)
            raise ValueError(f"content.{j}: a {kind!r} part: this server serves text models only (parts of type "
                             f"{allowed})")
    return data


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null: an assistant turn that said nothing (a client sends back tool calls with it)
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    # an assistant's calls, sent back with the results
    tool_calls: "Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None" = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's reasoning sent back (vLLM's name, and its older one): handed to the
    # template as reasoning_content, which Qwen3's renders for the turns after the last
    # user message and drops before it.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts(cls, data):
        return text_parts_only(data, ("text",))

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (only an assistant's may be null)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatTemplateFields(Lenient):
    """How messages become a prompt (vLLM's chat extensions): shared by chat completions and /tokenize."""

    add_generation_prompt: bool = True  # end the prompt with the assistant's opening
    continue_final_message: bool = False  # or: carry on the last (assistant) message, unclosed
    chat_template: str | None = None  # a Jinja template for this request (needs --trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (enable_thinking...)

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_open(cls, value, info):
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message=true needs add_generation_prompt=false: the prompt either "
                             "opens a new assistant message or continues the last one")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, value):
        taken = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set through chat_template_kwargs (the server sets them; "
                             f"use the request's own fields where there is one)")
        return value


# -- structured output and tools (chapter 18; what they do is in server/tools.py) -------


class JsonSchemaFormat(Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # Text Generation Inference's form, which huggingface_hub's InferenceClient sends:
    # {"type": "json_object", "value": schema}. The schema applies, as json_schema's would.
    value: dict | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is given with type 'json_schema', and only then")
        if self.value is not None and self.type != "json_object":
            raise ValueError("value (a JSON schema) is given with type 'json_object' only")
        return self


class StructuredOutputsField(Lenient):
    """vLLM's ``structured_outputs`` request field (StructuredOutputsParams checks the rest)."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_fallback: bool = False  # vLLM's; this server has no other grammar engine to fall back to
    # vLLM's, for its other grammar engines: refused unless they ask for nothing
    whitespace_pattern: str | None = None
    structural_tag: str | dict | None = None
    disable_additional_properties: bool = False

    @field_validator("whitespace_pattern", "structural_tag", "disable_additional_properties")
    @classmethod
    def _not_here(cls, value, info):
        if value not in (None, False):
            why = {"whitespace_pattern": "the JSON grammar is compact, or with disable_any_whitespace=false allows "
                                         "any whitespace",
                   "structural_tag": "give the constraint as json, regex, choice or grammar",
                   "disable_additional_properties": "a schema says additionalProperties: false itself"}
            raise ValueError(f"not supported by this server ({why[info.field_name]})")
        return value

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object,
                                       disable_any_whitespace=self.disable_any_whitespace)


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (none: no arguments)
    strict: bool | None = None


class ToolDefinition(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(Lenient):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(Lenient):
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, StructuredFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None  # None: until the context is full
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's: when the last message is the assistant's (continue_final_message), the answer
    # starts with that message's text, and the new text follows.
    echo: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value


class ResponseInputText(Lenient):
    type: Literal["input_text", "output_text"]  # (an assistant turn sent back holds output_text)
    text: str


class ResponseInputMessage(Lenient):
    """One message of a Responses ``input`` list."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ResponseInputText], Field(max_length=MAX_CONTENT_PARTS)]

    @model_validator(mode="before")
    @classmethod
    def _text_parts(cls, data):
        return text_parts_only(data, ("input_text", "output_text"))

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFunctionCall(Lenient):
    """A call the model made, sent back in a later request's ``input`` (an output item)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class ResponseFunctionCallOutput(Lenient):
    """What a call returned: the tool's message in the conversation."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ResponseReasoningItem(Lenient):
    """A reasoning item sent back with the output it came in: the chat template leaves a
    past turn's reasoning out of the prompt, and so does this server."""

    type: Literal["reasoning"]


ResponseInputItem = ResponseInputMessage | ResponseFunctionCall | ResponseFunctionCallOutput | ResponseReasoningItem


class ResponseTool(Lenient):
    """A function the model may call (Responses' flat form of chat's ``tools`` entry)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data):
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"a {kind!r} tool: this server runs no tools of its own; give functions "
                             f"({{'type': 'function', 'name': ..., 'parameters': {{...}}}}) and run them yourself")
        return data


class ResponseNamedTool(Lenient):
    type: Literal["function"]
    name: str


class ResponsesRequest(Lenient):
    """OpenAI's Responses API (``POST /v1/responses``): ``input`` (a string, or a list of
    messages, function calls and their outputs) after ``instructions`` (a system message),
    through the chat template, as the chat completion ``chat_request`` builds. ``tools``
    (functions) and ``tool_choice`` work as chat's do; ``text.format`` (json_object,
    json_schema) constrains the output as chat's ``response_format`` does. Stored
    conversations (``previous_response_id``) are refused: this server stores nothing."""

    model: str | None = None
    input: str | Annotated[list[ResponseInputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True  # accepted: nothing is stored, so a response cannot be fetched back
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[ResponseTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedTool | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None
    previous_response_id: str | None = None

    @model_validator(mode="after")
    def _what_is_served(self):
        fmt = (self.text or {}).get("format", {"type": "text"})
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("text: format is {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
                             "'name': ..., 'schema': {...}}")
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: this server stores no responses; send the whole conversation "
                             "as input")
        return self

    def chat_request(self) -> "ChatCompletionRequest":
        """The same request as a chat completion, which the chat route's checks and engine run."""
        fields = {"model": self.model, "messages": self.chat_messages(), "max_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "user": self.user,
                  "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else {
                "type": "function", "function": {"name": self.tool_choice.name}}
        fmt = dict((self.text or {}).get("format", {"type": "text"}))
        if fmt["type"] == "json_schema":  # Responses' format holds the schema's fields; chat's nests them
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                k: v for k, v in fmt.items() if k in ("name", "description", "schema", "strict")}}
        elif fmt["type"] == "json_object":
            fields["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:  # (a text.format the chat's response_format refuses, a bad tool)
            error = e.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            param = "text" if where.startswith("response_format") else where.partition(".")[0]
            raise APIError(400, f"{where.replace('response_format', 'text.format')}: {error['msg']}",
                           param=param) from None

    def chat_messages(self) -> list[dict]:
        """``instructions`` and ``input`` as chat messages: a function call joins the assistant
        message before it (or starts one), its output is a tool message."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [ResponseInputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, ResponseInputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, ResponseFunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not (messages and messages[-1]["role"] == "assistant"):
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(call)
            elif isinstance(item, ResponseFunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a text or a conversation (through the chat template), to token ids."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)  # rendered by the template
    # False, as /v1/completions tokenizes a prompt here, so that the count is what a
    # completion would be charged (vLLM's default is True).
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        return self


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


# Arguments of apply_chat_template, and the variables it gives the template itself: a
# request's chat_template_kwargs may not replace them (they would break the rendering or
# make it return something other than the text the server expects).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


def _neutral(*values):
    """A check that passes only the values that ask for nothing (the field's default)."""
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


# Fields that OpenAI or vLLM define and this server cannot honour yet: unlike a field it has
# never heard of, one of these changes what the client gets back, so a value other than
# its do-nothing default is a 400 naming it rather than a silent no-op.
NOT_SUPPORTED = {
    "use_beam_search": _neutral(None, False),
    "logits_processors": _neutral(None, []),
    "functions": _neutral(None, []),  # the deprecated spelling of tools
    "function_call": _neutral(None, "none", "auto"),
    "response_format": _neutral(None),  # /v1/completions and the chat take it: elsewhere refused
    # The grammar engine takes no whitespace pattern: JSON is compact (structured_outputs'
    # disable_any_whitespace, the default) or allows any whitespace (false).
    "guided_whitespace_pattern": _neutral(None),
    "structural_tag": _neutral(None),
    # /v1/completions and the chat take these (vLLM's older structured_outputs): elsewhere refused
    "guided_json": _neutral(None),
    "guided_regex": _neutral(None),
    "guided_choice": _neutral(None),
    "guided_grammar": _neutral(None),
    "guided_json_object": _neutral(None, False),
    "guided_decoding_backend": _neutral(None),
}


def parse_request(body: bytes, model: type[Strict]) -> Strict:
    """The body as ``model``, or an APIError(400) naming the first bad field. Fields ``model``
    does not know are left in the result's ``model_extra`` (see ``ignored_fields``), except
    those in NOT_SUPPORTED, which are refused unless they ask for nothing."""
    if len(body) > PRESCAN_BYTES:
        check_structure(body)
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {error['msg']}") from None
        loc = [str(part) for part in error["loc"]]
        where = ".".join(loc) or "body"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = f"unknown field (accepted: {', '.join(sorted(model.model_fields))})"
        if not loc:  # a check of the whole body: its message starts with the field it blames
            blamed = message.partition(":")[0]
            raise APIError(400, message, param=blamed if blamed in model.model_fields else None) from None
        raise APIError(400, f"{where}: {message}", param=loc[0]) from None
    for name, value in (parsed.model_extra or {}).items():
        check = NOT_SUPPORTED.get(name)
        if check is not None and not check(value):
            raise APIError(400, f"{name}: not supported by this server (leave it out)", param=name)
    return parsed


class _TooManyMembers(Exception):
    pass


def check_structure(body: bytes) -> None:
    """Refuse a body of more than MAX_JSON_MEMBERS objects and keys, counted while Python's
    parser reads it and stopped at the first one past the limit: what the request models
    would build from it (half a million empty messages took 2 GB and 12 s) is never built.
    Invalid JSON is left to the parser, which says where."""
    # Every object has a "{" and every key a ":" after it: a body with fewer of those bytes
    # than the limit is under it, and skips the count (counting bytes is a pass in C).
    if body.count(b"{") + body.count(b":") <= MAX_JSON_MEMBERS:
        return
    count = 0

    def counted(pairs):
        nonlocal count
        count += 1 + len(pairs)
        if count > MAX_JSON_MEMBERS:
            raise _TooManyMembers
        return None  # (the objects themselves are not kept: the request model parses the body)

    try:
        json.loads(body, object_pairs_hook=counted)
    except _TooManyMembers:
        raise APIError(400, f"the request body holds more than {MAX_JSON_MEMBERS} JSON objects and keys (at most "
                            f"{MAX_MESSAGES} messages of at most {MAX_CONTENT_PARTS} parts, {MAX_TOOLS} tools)",
                       code="request_too_complex") from None
    except (ValueError, RecursionError):  # (not JSON, or nested past Python's parser: the model's parser says so)
        return


def ignored_fields(body: Lenient) -> list[str]:
    """The fields of a parsed request that nothing reads (they are logged, then ignored):
    the body's own and those of its messages and their parts, as dotted paths."""
    found = [name for name in body.model_extra or {} if name not in NOT_SUPPORTED]
    declared = type(body).model_fields  # (an undeclared "messages" is an ignored extra, not a list)
    parts = [("stream_options", body.stream_options if "stream_options" in declared else None),
             ("structured_outputs", body.structured_outputs if "structured_outputs" in declared else None)]
    for i, message in enumerate((body.messages if "messages" in declared else None) or []):
        parts.append((f"messages.{i}", message))
        if isinstance(message.content, list):
            parts += [(f"messages.{i}.content.{j}", p) for j, p in enumerate(message.content)]
    for where, part in parts:
        if part is not None:
            found += [f"{where}.{name}" for name in part.model_extra or {}]
    return found


# The sampling fields that a checkpoint's generation_config.json may give defaults for.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p")


def apply_defaults(request: SamplingFields, defaults: dict) -> None:
    """Fill the sampling fields the request left out from ``defaults`` (the model's
    generation_config.json): what its authors tuned it for, as vLLM's server does."""
    for name in DEFAULTABLE:
        if name in defaults and getattr(request, name) is None:
            setattr(request, name, defaults[name])


def with_extensions(params: SamplingParams, request: SamplingFields) -> SamplingParams:
    """``params`` (the fields to_sampling_params maps) with the rest of the request's sampling
    fields: n, the penalties, logit_bias and vLLM's extensions, checked by SamplingParams."""
    extra = {"n": request.n, "presence_penalty": request.presence_penalty or 0.0,
             "frequency_penalty": request.frequency_penalty or 0.0,
             "repetition_penalty": 1.0 if request.repetition_penalty is None else request.repetition_penalty,
             "logit_bias": {int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None,
             "bad_words": request.bad_words, "allowed_token_ids": request.allowed_token_ids,
             "include_stop_str_in_output": request.include_stop_str_in_output,
             "truncate_prompt_tokens": request.truncate_prompt_tokens,
             "prompt_logprobs": request.prompt_logprobs}
    if isinstance(request, CompletionRequest) and request.echo and request.prompt_logprobs is None:
        extra["prompt_logprobs"] = request.logprobs  # the echoed prompt's tokens carry logprobs too (vLLM's rule)
    if all(getattr(params, k) == v for k, v in extra.items()):
        return params
    try:
        return dataclasses.replace(params, **extra)
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param) from None


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """Map the request's sampling fields onto SamplingParams (which checks the ranges)."""
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        max_tokens, logprobs = request.max_tokens, request.logprobs
        if request.echo and max_tokens == 0:
            # Only the prompt, scored. The engine draws one token, which the answer leaves
            # out (as vLLM does; its usage counts that token, and so does ours).
            max_tokens = 1
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if request.top_k is None else request.top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
        )
    except InvalidParameter as e:
        param = e.param
        if param == "logprobs" and isinstance(request, ChatCompletionRequest):
            param = "top_logprobs"
        raise APIError(400, str(e), param=param) from None


# -- responses -------------------------------------------------------------------------


def usage(*outputs: RequestOutput, reasoning_tokens: int | None = None) -> dict:
    """The usage of one request, or the sum over a batch's (every completion counted);
    ``reasoning_tokens`` (with a reasoning parser): how many of the completions' tokens were
    reasoning, in ``completion_tokens_details`` as OpenAI's and vLLM's answers say it."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    counted = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        counted["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counted


def completion_logprobs(completion: CompletionOutput, k: int, start: int = 0, offset: int = 0,
                        as_ids: bool = False) -> dict | None:
    """Completions' logprobs object for tokens ``start:`` of the completion (the ``k`` most
    likely tokens at each step; ``text_offset`` counts characters from the completion's start,
    plus ``offset``). ``as_ids``: tokens named "token_id:<id>" (return_tokens_as_token_ids)."""
    if completion.logprobs is None:
        return None
    pieces = [entry[t].decoded_token or "" for t, entry in zip(completion.token_ids, completion.logprobs)]
    offset += sum(map(len, pieces[:start]))
    return _logprobs_object(completion.token_ids[start:], completion.logprobs[start:], k, offset, as_ids=as_ids)[0]


def echo_logprobs(output: RequestOutput, completion: CompletionOutput | None, k: int, first_token: str,
                  as_ids: bool = False) -> dict:
    """Completions' logprobs object for an echoed prompt: the prompt's tokens (the first
    with null logprobs, its text ``first_token``), then the completion's tokens so far, if
    ``completion`` (None: the prompt alone, for max_tokens 0); offsets from the prompt's start."""
    scored = _logprobs_object(output.prompt_token_ids, output.prompt_logprobs, k, 0, first_token, as_ids)
    prompt, offset = scored
    if completion is not None and completion.logprobs is not None:
        rest, _ = _logprobs_object(completion.token_ids, completion.logprobs, k, offset, as_ids=as_ids)
        prompt = {key: prompt[key] + rest[key] for key in prompt}
    return prompt


def echo_offset(output: RequestOutput, first_token: str) -> int:
    """Where an echoed prompt's completion starts, in ``text_offset``'s characters."""
    return len(first_token) + sum(len(e[t].decoded_token or "")
                                  for t, e in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]))


def _logprobs_object(token_ids, entries, k: int, offset: int, first_token: str = "",
                     as_ids: bool = False) -> tuple[dict, int]:
    """The completions logprobs object of these tokens and their entries (an entry None:
    the prompt's first token, unscored, whose text is ``first_token``), and the offset after
    them (counted in the tokens' text, also when ``as_ids`` names them by id)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            piece = first_token
            token_logprobs.append(None)
            top.append(None)
        else:
            piece = entry[token_id].decoded_token or ""
            token_logprobs.append(max(entry[token_id].logprob, MIN_LOGPROB))
            top.append({token_name(t, lp, as_ids): max(lp.logprob, MIN_LOGPROB) for t, lp in _top(entry, k)})
        tokens.append(f"token_id:{token_id}" if as_ids else piece)
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


# JSON has no -inf: a log-probability below this is sent as this (OpenAI's and vLLM's value).
MIN_LOGPROB = -9999.0


def prompt_logprobs(output: RequestOutput) -> list | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, null for the first, else
    {token id: {logprob, rank, decoded_token}} (the token and its top k)."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()}
            for entry in output.prompt_logprobs]


def chat_logprobs(completion: CompletionOutput, k: int, start: int = 0, as_ids: bool = False) -> dict | None:
    """Chat's logprobs object (``content``: one entry per token) for tokens ``start:``;
    ``as_ids``: tokens named "token_id:<id>" (return_tokens_as_token_ids)."""
    if completion.logprobs is None:
        return None

    def item(token_id: int, lp) -> dict:
        text = token_name(token_id, lp, as_ids)
        return {"token": text, "logprob": lp.logprob, "bytes": list((lp.decoded_token or "").encode())}

    content = []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        content.append({**item(token_id, entry[token_id]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, k)]})
    return {"content": content}


def token_name(token_id: int, lp, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else (lp.decoded_token or "")


def _top(entry: dict, k: int) -> list:
    """The k most likely tokens of a step as (id, Logprob), most likely first. (The engine also
    puts the chosen token in ``entry`` when it ranked below k; it is not one of the top k.)"""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)


def now() -> int:
    return int(time.time())


StructuredFields.model_rebuild()
CompletionRequest.model_rebuild()
ChatMessage.model_rebuild()
ChatCompletionRequest.model_rebuild()
TokenizeRequest.model_rebuild()
