"""Structured output and tool calls on the server (chapter 18).

What a request's ``response_format``, ``structured_outputs``, ``tools`` and ``tool_choice``
ask for becomes one ``StructuredOutputsParams`` (or none), and what the model wrote becomes
OpenAI's answer:

- ``response_format``: ``json_object`` is any JSON object; ``json_schema`` follows its
  schema (always: ``strict`` or not, the grammar allows nothing else).
- ``tool_choice`` naming a function: the output is that function's arguments, constrained to
  its ``parameters`` schema, and comes back as one tool call (finish_reason ``tool_calls``).
- ``required``: the output is a JSON array of ``{"name", "parameters"}`` objects, each
  constrained to one of the tools (vLLM's shape); every item becomes a tool call.
- ``auto``: nothing is constrained; the model's own tool-call syntax is parsed from its text
  by the parser of its family (``TOOL_PARSERS``), and streamed as tool-call deltas, one per
  call as each call closes, the text around them as content.
- ``none`` (or no tools): plain text. The tools still reach the chat template.
"""
import json
import uuid
from dataclasses import dataclass, field

from minivllm.sampling_params import InvalidParameter
from minivllm.server.protocol import APIError, NamedToolChoice
from minivllm.structured import StructuredOutputsParams

NO_ARGUMENTS = {"type": "object", "properties": {}}
# The most calls one required answer may make: the array's grammar must end somewhere, or a
# model that likes "," could call tools until max_tokens.
MAX_TOOL_CALLS = 8


def structured_outputs(body) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a request asks for, and the field it came from (to name in errors)."""
    asked = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type != "text":
        asked.append("response_format")
    if getattr(body, "structured_outputs", None) is not None:
        asked.append("structured_outputs")
    plan = tool_plan(body)
    if plan is not None and plan.mode in ("named", "required"):
        asked.append("tool_choice")
    if len(asked) > 1:
        raise APIError(400, f"{asked[1]}: cannot be combined with {asked[0]} (one constraint per request)",
                       param=asked[1])
    if not asked:
        return None, None
    source = asked[0]
    try:
        if source == "response_format":
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True), source
            return StructuredOutputsParams(json=rf.json_schema.schema_), source
        if source == "structured_outputs":
            fields = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            return StructuredOutputsParams(**fields), source
        return plan.constraint(), source
    except InvalidParameter as e:
        raise APIError(400, f"{source}: {e}", param=source) from None


# -- tools ---------------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "named" | "required"
    tools: list[dict]  # the functions' definitions, as sent
    name: str | None = None  # the named function
    parallel: bool = True

    def parameters(self, name: str) -> dict:
        fn = next(t for t in self.tools if t["name"] == name)
        return fn.get("parameters") or NO_ARGUMENTS

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters(self.name))
        if self.mode == "required":
            calls = {"type": "array", "minItems": 1,
                     "items": {"anyOf": [{"type": "object", "properties": {
                         "name": {"type": "string", "enum": [t["name"]]}, "parameters": self.parameters(t["name"])},
                         "required": ["name", "parameters"]} for t in self.tools]}}
            calls["maxItems"] = MAX_TOOL_CALLS if self.parallel else 1
            return StructuredOutputsParams(json=calls)
        return None


def tool_plan(body) -> ToolPlan | None:
    """What the request's tools and tool_choice mean (None: no tools)."""
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: needs tools", param="tool_choice")
        return None
    definitions = [t.function.model_dump(exclude_none=True) for t in tools]
    names = [d["name"] for d in definitions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    parallel = body.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice: no tool is named {choice.function.name!r} (tools: {', '.join(names)})",
                           param="tool_choice")
        return ToolPlan("named", definitions, choice.function.name, parallel)
    return ToolPlan(choice or "auto", definitions, parallel=parallel)


def template_messages(messages) -> list[dict]:
    """The request's messages as the chat template takes them: a tool result with its call's
    id, an assistant's calls with their arguments as objects (as Qwen's and Hermes' templates
    read them, and vLLM passes them)."""
    out = []
    for m in messages:
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _as_object(c.function.arguments)}} for c in m.tool_calls]
        out.append(message)
    return out


def _as_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def constrained_calls(plan: ToolPlan, text: str, finished: bool) -> list[ToolCall]:
    """The calls of a named or required output (those complete so far, while it runs)."""
    if plan.mode == "named":
        return [ToolCall(plan.name, text)]
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in complete_array_items(text)]


def complete_array_items(text: str) -> list:
    """The items of a JSON array that are complete in ``text`` (a prefix of the array)."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[")
    if at < 0:
        return items
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


# -- parsing the model's own tool-call syntax (tool_choice auto) ------------------------------


class HermesToolParser:
    """Hermes' and Qwen's syntax (Qwen2.5, Qwen3, QwQ and Hermes 2/3 models):
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them,
    text around them."""

    start, end = "<tool_call>", "</tool_call>"

    def split(self, text: str, finished: bool) -> tuple[str, list[ToolCall], str]:
        """(content, the calls complete in ``text``, what is still undecided). The content
        holds back a tail that may be the start of a call's opening tag, until it is not."""
        content, calls = [], []
        at = 0
        while True:
            open_at = text.find(self.start, at)
            if open_at < 0:
                break
            close_at = text.find(self.end, open_at)
            if close_at < 0:
                if finished:  # a call never closed: it is text, not a call
                    break
                content.append(text[at:open_at])
                return "".join(content), calls, text[open_at:]
            call = parse_call(text[open_at + len(self.start) : close_at], "arguments")
            if call is None:  # not a call after all: keep it as the model wrote it
                content.append(text[at : close_at + len(self.end)])
            else:
                content.append(text[at:open_at])
                calls.append(call)
            at = close_at + len(self.end)
        rest = text[at:]
        held = 0 if finished else _partial_suffix(rest, self.start)
        content.append(rest[: len(rest) - held])
        return "".join(content), calls, rest[len(rest) - held :]


class Llama3JsonToolParser:
    """Llama 3.x's JSON syntax: the whole reply is ``{"name": ..., "parameters": {...}}``
    (several separated by ``;``), optionally after ``<|python_tag|>``."""

    def split(self, text: str, finished: bool) -> tuple[str, list[ToolCall], str]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, [], ""
        if not finished:
            return "", [], text  # may be a call: decided when it ends
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, [], ""
            call = call_of(obj, "parameters")
            if call is None:
                return text, [], ""
            calls.append(call)
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return "", calls, ""


TOOL_PARSERS = {"hermes": HermesToolParser, "qwen": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def parse_call(text: str, arguments_key: str) -> ToolCall | None:
    """One call's JSON, or None if it is not one (not JSON, or without a name)."""
    try:
        return call_of(json.loads(text), arguments_key)
    except json.JSONDecodeError:
        return None


def call_of(obj, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# -- the answer ------------------------------------------------------------------------------


class ToolAnswer:
    """One choice's message and finish_reason with tools, whole or as stream deltas."""

    def __init__(self, plan: ToolPlan, parser_name: str):
        if parser_name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {parser_name!r} (known: {', '.join(TOOL_PARSERS)})")
        self.plan = plan
        self.parser = TOOL_PARSERS[parser_name]()
        self.sent_content = 0
        self.sent_calls: list[ToolCall] = []
        self.sent_arguments = 0  # a named call streams its arguments as they come

    def split(self, text: str, finished: bool) -> tuple[str | None, list[ToolCall]]:
        if self.plan.mode in ("named", "required"):
            return None, constrained_calls(self.plan, text, finished)
        content, calls, _ = self.parser.split(text, finished)
        return content, calls

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        return "tool_calls" if reason == "stop" and calls else reason

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        content, calls = self.split(text, True)
        if self.plan.mode == "auto":
            content = content.strip() if calls else content
        message = {"role": "assistant", "content": content or None if calls else content or ""}
        if calls:
            message["tool_calls"] = [c.json() for c in calls]
        return message, self.finish_reason(reason, calls)

    def delta(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """What a stream sends for a choice whose text is now ``text``."""
        finished = reason is not None
        if self.plan.mode == "named":
            delta = {}
            if not self.sent_calls:
                self.sent_calls = [ToolCall(self.plan.name, "")]
                delta["tool_calls"] = [{"index": 0, **self.sent_calls[0].json()}]
            new = text[self.sent_arguments :]
            self.sent_arguments = len(text)
            if new:
                delta.setdefault("tool_calls", [{"index": 0, "function": {}}])[0]["function"]["arguments"] = new
            return delta, self.finish_reason(reason, self.sent_calls)
        content, calls = self.split(text, finished)
        delta = {}
        if content is not None and len(content) > self.sent_content:
            delta["content"] = content[self.sent_content :]
            self.sent_content = len(content)
        new = calls[len(self.sent_calls) :]
        if new:
            delta["tool_calls"] = [{"index": len(self.sent_calls) + i, **c.json()} for i, c in enumerate(new)]
            self.sent_calls += new
        return delta, self.finish_reason(reason, self.sent_calls)
