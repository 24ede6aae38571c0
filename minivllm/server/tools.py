"""Structured output and tool calls on the server (chapter 18).

What a request's ``response_format``, ``structured_outputs`` (or vLLM's older ``guided_*``
fields), ``tools`` and ``tool_choice`` ask for becomes one ``StructuredOutputsParams`` (or
none), and what the model wrote becomes OpenAI's answer:

- ``response_format``: ``json_object`` is any JSON object (or, with Text Generation
  Inference's ``value``, one that follows that schema); ``json_schema`` follows its schema
  (always: ``strict`` or not, the grammar allows nothing else).
- ``tools`` and ``tool_choice``: as ``minivllm.structured.tools`` plans them (shared with the
  offline ``LLM.chat``). A named or required choice comes back as tool calls (finish_reason
  ``tool_calls`` for required, ``stop`` for named, as vLLM's); with ``auto`` the model's own syntax is parsed from its text by the
  parser of its family (``--tool-call-parser``), and streamed as tool-call deltas, one per
  call as each call closes, the text around them as content.
"""
import functools
import logging

from minivllm.sampling_params import InvalidParameter
from minivllm.server.protocol import APIError, NamedToolChoice
from minivllm.structured import StructuredOutputsParams
from minivllm.structured.tools import (TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser, ToolCall, ToolPlan,
                                       complete_array_items, constrained_calls, parse_tool_calls, template_tool_calls,
                                       tool_parser)
from minivllm.structured.tools import tool_plan as shared_tool_plan

logger = logging.getLogger(__name__)

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "ToolAnswer", "ToolCall", "ToolPlan",
           "complete_array_items", "structured_outputs", "template_messages", "tool_plan"]


# vLLM's older request fields, each one field of structured_outputs.
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_json_object": "json_object"}


def structured_outputs(body) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a request asks for, and the field it came from (to name in errors)."""
    asked = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type != "text":
        asked.append("response_format")
    if getattr(body, "structured_outputs", None) is not None:
        asked.append("structured_outputs")
    asked += [name for name in LEGACY_FIELDS if getattr(body, name, None) not in (None, False)]
    plan = tool_plan(body)
    if plan is not None and plan.mode in ("named", "required"):
        asked.append("tool_choice")
    if len(asked) > 1:
        old = next((name for name in asked[:2] if name in LEGACY_FIELDS), None)
        why = f"; {old} is vLLM's older name for structured_outputs.{LEGACY_FIELDS[old]}" if old else ""
        raise APIError(400, f"{asked[1]}: cannot be combined with {asked[0]} (one constraint per request{why})",
                       param=asked[1])
    if not asked:
        return None, None
    source = asked[0]
    try:
        if source == "response_format":
            if rf.type == "json_object":
                if rf.value is not None:  # (TGI's form: a schema for the object)
                    return StructuredOutputsParams(json=rf.value), source
                return StructuredOutputsParams(json_object=True), source
            return StructuredOutputsParams(json=rf.json_schema.schema_), source
        if source == "structured_outputs":
            return body.structured_outputs.params(), source
        if source in LEGACY_FIELDS:
            warn_legacy(source)
            return StructuredOutputsParams(**{LEGACY_FIELDS[source]: getattr(body, source)}), source
        return plan.constraint(), source
    except InvalidParameter as e:
        raise APIError(400, f"{source}: {e}", param=source) from None


@functools.cache
def warn_legacy(name: str) -> None:
    """Once per field and process: the log says what to write instead."""
    logger.warning("%s is vLLM's older name for structured_outputs.%s (removed from vLLM in 0.12): accepted, but "
                   "send {\"structured_outputs\": {\"%s\": ...}} instead", name, LEGACY_FIELDS[name],
                   LEGACY_FIELDS[name])


# -- tools ---------------------------------------------------------------------------------


def tool_plan(body) -> ToolPlan | None:
    """What the request's tools and tool_choice mean (None: no tools)."""
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump(exclude_none=True)
    try:
        return shared_tool_plan([t.model_dump(exclude_none=True) for t in tools or []], choice,
                                getattr(body, "parallel_tool_calls", True))
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param) from None


def template_messages(messages) -> list[dict]:
    """The request's messages as the chat template takes them: a tool result with its call's
    id, an assistant's calls with their arguments as objects (``template_tool_calls``)."""
    out = []
    for m in messages:
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = template_tool_calls([c.model_dump() for c in m.tool_calls])
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None and m.role == "assistant":
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


# -- the answer ------------------------------------------------------------------------------


class ToolAnswer:
    """One choice's message and finish_reason with tools, whole or as stream deltas."""

    def __init__(self, plan: ToolPlan, parser_name: str):
        self.plan = plan
        self.parser_name = parser_name
        self.parser = tool_parser(parser_name)
        self.sent_content = 0
        self.sent_calls: list[ToolCall] = []
        self.sent_arguments = 0  # a named call streams its arguments as they come

    def split(self, text: str, finished: bool) -> tuple[str | None, list[ToolCall]]:
        if self.plan.mode in ("named", "required"):
            return None, constrained_calls(self.plan, text)
        content, calls, _ = self.parser.split(text, finished)
        return content, calls

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        """"tool_calls" for calls the model chose to make (auto, required); a named call was the
        client's choice, and ends "stop" as vLLM ends it."""
        return "tool_calls" if reason == "stop" and calls and self.plan.mode != "named" else reason

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        content, calls = parse_tool_calls(text, self.plan, self.parser_name)
        message = {"role": "assistant", "content": content if calls else content or ""}
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
