"""Tool calls (chapter 18), shared by the offline ``LLM.chat`` and the server: what a
request's ``tools`` and ``tool_choice`` ask of the output, and the calls read back from it.

- ``tool_choice`` naming a function: the output is that function's arguments, constrained to
  its ``parameters`` schema: one call.
- ``required``: the output is a JSON array of ``{"name", "parameters"}`` objects, each
  constrained to one of the tools (vLLM's shape); every item is a call.
- ``auto``: nothing is constrained; the model's own tool-call syntax is parsed from its text
  by the parser of its family (``TOOL_PARSERS``).
- ``none`` (or no tools): plain text. The tools still reach the chat template.

Tools and choices are OpenAI's dicts (``{"type": "function", "function": {"name",
"description", "parameters"}}``; ``{"type": "function", "function": {"name"}}``). A bad one
raises ``InvalidParameter`` naming ``tools`` or ``tool_choice``.
"""
import json
import uuid
from dataclasses import dataclass, field

from minivllm.errors import InvalidParameter
from minivllm.structured.params import StructuredOutputsParams

NO_ARGUMENTS = {"type": "object", "properties": {}}
# The most calls one required answer may make: the array's grammar must end somewhere, or a
# model that likes "," could call tools until max_tokens.
MAX_TOOL_CALLS = 8
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def json(self) -> dict:
        """OpenAI's shape, as a chat answer's ``tool_calls`` holds it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "named" | "required"
    tools: list[dict]  # the functions' definitions ({"name", "description", "parameters"})
    name: str | None = None  # the named function
    parallel: bool = True

    def parameters(self, name: str) -> dict:
        fn = next(t for t in self.tools if t["name"] == name)
        return fn.get("parameters") or NO_ARGUMENTS

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must follow (None: ``auto`` and ``none`` leave it free)."""
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


def tool_plan(tools: list[dict] | None, tool_choice=None, parallel_tool_calls: bool = True) -> ToolPlan | None:
    """What ``tools`` and ``tool_choice`` mean (None: no tools). ``tool_choice`` left out is
    ``auto`` when there are tools, as OpenAI's API has it."""
    if tool_choice is not None and not (tool_choice in TOOL_CHOICES or isinstance(tool_choice, dict)):
        _fail("tool_choice", f"must be one of {', '.join(map(repr, TOOL_CHOICES))} or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
    if not tools:
        if tool_choice not in (None, "none"):
            _fail("tool_choice", "needs tools")
        return None
    if not isinstance(tools, (list, tuple)) or len(tools) > MAX_TOOLS:
        _fail("tools", f"must be a list of at most {MAX_TOOLS} tools")
    definitions = [_definition(t, i) for i, t in enumerate(tools)]
    names = [d["name"] for d in definitions]
    if len(set(names)) != len(names):
        _fail("tools", "function names must be unique")
    if not isinstance(parallel_tool_calls, bool):
        _fail("parallel_tool_calls", "must be a bool")
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            _fail("tool_choice", "a named choice is {'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            _fail("tool_choice", f"no tool is named {name!r} (tools: {', '.join(names)})")
        return ToolPlan("named", definitions, name, parallel_tool_calls)
    return ToolPlan(tool_choice or "auto", definitions, parallel=parallel_tool_calls)


def _definition(tool, i: int) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        _fail("tools", f"tool {i} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        _fail("tools", f"tool {i}'s function needs a name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        _fail("tools", f"tool {i}'s parameters must be a JSON schema (a dict)")
    return function


def _fail(param: str, message: str) -> None:
    raise InvalidParameter(f"{param}: {message}", param)


# -- messages through the chat template ----------------------------------------------------


def template_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """An assistant's calls as chat templates read them: OpenAI sends each call's arguments
    as JSON text; Qwen's and Hermes' templates (and vLLM, which passes them so) want an object."""
    out = []
    for call in tool_calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            function["arguments"] = _as_object(function["arguments"])
        out.append({**call, "type": call.get("type", "function"), "function": function})
    return out


def _as_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


# -- reading the calls back ------------------------------------------------------------------


def parse_tool_calls(text: str, plan: ToolPlan | None, parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """A finished output's content and calls: what a chat answer's message holds. For a
    named or required choice the whole text is the calls (content None); for ``auto`` the
    model's own syntax is read by ``parser`` (one of TOOL_PARSERS), the text around the calls
    being the content; with no tools, or ``none``, the text is all content."""
    if plan is None or plan.mode == "none":
        return text, []
    if plan.mode in ("named", "required"):
        return None, constrained_calls(plan, text)
    content, calls, _ = tool_parser(parser).split(text, True)
    return (content.strip() or None if calls else content), calls


def tool_parser(name: str):
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]()


def constrained_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
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


# -- the model's own tool-call syntax (tool_choice auto) --------------------------------------


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
