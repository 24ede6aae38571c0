"""POST /v1/responses: OpenAI's Responses API, on the chat route's checks and engine.

The request becomes a chat completion (``ResponsesRequest.chat_request``: ``instructions`` as
a system message, then the input's messages, function calls and their outputs; the tools and
``tool_choice`` as chat's), and the answer is reshaped into output items: with
``--reasoning-parser``, a ``reasoning`` item first (``server.reasoning``); a ``message``
holding one ``output_text`` part for the text; and a ``function_call`` item per tool call
(read from the text as chat reads it, ``server.tools.ToolAnswer``). ``usage`` counts input and
output tokens (the reasoning's among them), and ``status`` is "incomplete" when
``max_output_tokens`` cut it short.

Streamed, it is OpenAI's event sequence: ``response.created``, ``response.in_progress``, then
per item ``response.output_item.added``, its deltas (``response.reasoning_text.delta``,
``response.output_text.delta`` inside a ``content_part``, or
``response.function_call_arguments.delta``), their ``.done`` events and
``response.output_item.done``; last ``response.completed`` (whose response's status may be
"incomplete"). Each event is named on an ``event:`` line as OpenAI's and vLLM's are. A whole
answer is built by the same ``ResponseItems`` from the final output, so both carry the same
items.
"""
import json
import uuid
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response

from minivllm.outputs import RequestOutput
from minivllm.server.async_engine import EngineDeadError, RequestFailedError
from minivllm.server.protocol import ResponsesRequest, now
from minivllm.server.reasoning import ReasoningSplitter, grammar_after_reasoning, reasoning_parser
from minivllm.server.serving_engine import OpenAIServingGeneration
from minivllm.server.streaming import EventStream, final_outputs, merged
from minivllm.server.tools import ToolAnswer, tool_plan


class OpenAIServingResponses(OpenAIServingGeneration):
    async def create_response(self, body: ResponsesRequest, request: Request):
        """The answer to a parsed Responses request: a dict, or an event stream with ``stream: true``."""
        chat = body.chat_request()
        params = self.sampling_params(chat)
        ids, text = self.truncate(*await self.encode_messages(chat), params)
        parser = reasoning_parser(self.config.reasoning_parser)
        grammar_after_reasoning(params, parser, self.tokenizer, ids)  # the model reasons freely first
        self.check_prompt(ids, params, "input", body=chat)
        plan = tool_plan(chat)
        response_id = f"resp_{uuid.uuid4().hex}"
        await self.compile_grammar(params, chat, request)  # text.format's schema, a 400 if it does not compile
        outputs = self.start([(ids, text)], params, response_id, request)
        shell = {"id": response_id, "object": "response", "created_at": now(), "model": self.model_name,
                 "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                 "temperature": params.temperature, "top_p": params.top_p,
                 "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                 "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
                                 else body.tool_choice.model_dump()) or "auto",
                 "parallel_tool_calls": body.parallel_tool_calls,
                 "text": {"format": (body.text or {}).get("format", {"type": "text"})},
                 "metadata": body.metadata or {}, "error": None, "incomplete_details": None, "user": body.user}
        answer = ToolAnswer(plan, self.config.tool_call_parser) if plan is not None and plan.mode != "none" else None
        items = ResponseItems(answer, parser.splitter(text) if parser is not None else None, self.tokenizer)
        if body.stream:
            return EventStream(response_events(outputs, shell, items))
        finals = await final_outputs(outputs, request)
        if finals is None:
            return Response(status_code=499)  # the client left; nobody reads this
        items.update(finals[0].outputs[0].text, finals[0].outputs[0].finish_reason)
        items.close(finals[0].outputs[0].finish_reason)
        return finished(shell, items, finals[0])


def message_item(message_id: str) -> dict:
    """A message output item as it opens; it holds its text part once the text is complete."""
    return {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseItems:
    """The output items of one response as its text grows, and the events that tell a
    stream about them (``events``, taken by the stream as they come). ``splitter``: how the
    reasoning, if any, is told from the rest (``--reasoning-parser``; it becomes a
    ``reasoning`` item first); ``answer``: how the rest splits into content and tool calls
    (None: no tools, all of it is content); ``tokenizer``: the model's, to count the
    reasoning's tokens (needed with a splitter)."""

    def __init__(self, answer: ToolAnswer | None, splitter: ReasoningSplitter | None = None, tokenizer=None):
        self.answer = answer
        self.splitter = splitter
        self.tokenizer = tokenizer
        self.reasoning: dict | None = None  # the reasoning item open now (its text is self.thought)
        self.thought = ""
        self.items: list[dict] = []  # in output order, open or done
        self.events: list[tuple[str, dict]] = []
        self.message: dict | None = None  # the message item open now (its text is self.text)
        self.text = ""
        self.sent = 0  # characters of the output's text handled, without tools
        self.calls: dict[int, dict] = {}  # a tool call's index in the answer -> its item

    def update(self, text: str, reason: str | None) -> None:
        """The output's text is now ``text``."""
        if self.splitter is not None:
            thought, _ = self.splitter.feed(text, reason is not None)
            if thought:
                self._reason(thought)
            text = self.splitter.content
        if self.answer is None:
            delta = {"content": text[self.sent:]}
            self.sent = len(text)
        else:
            delta, _ = self.answer.delta(text, reason)
        if delta.get("content"):
            self._text(delta["content"])
        for call in delta.get("tool_calls", ()):
            self._call(call)

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of the output's tokens (``token_ids``, the whole output) are its reasoning."""
        if self.splitter is None:
            return 0
        return self.splitter.parser.reasoning_tokens(self.tokenizer, token_ids, self.splitter.reasoning_text())

    def _where(self, item_id: str) -> dict:
        return {"item_id": item_id, "output_index": next(i for i, item in enumerate(self.items)
                                                          if item["id"] == item_id)}

    def _reason(self, delta: str) -> None:
        if self.reasoning is None:
            self.reasoning = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [],
                              "status": "in_progress"}
            self.items.append(self.reasoning)
            self.events.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                                "item": dict(self.reasoning)}))
        self.thought += delta
        self.events.append(("response.reasoning_text.delta", {**self._where(self.reasoning["id"]),
                                                               "content_index": 0, "delta": delta}))

    def _close_reasoning(self, status: str) -> None:
        if self.reasoning is None or self.reasoning["status"] != "in_progress":
            return
        where = self._where(self.reasoning["id"])
        self.reasoning.update(status=status, content=[{"type": "reasoning_text", "text": self.thought}])
        self.events += [("response.reasoning_text.done", {**where, "content_index": 0, "text": self.thought}),
                        ("response.output_item.done", {"output_index": where["output_index"],
                                                        "item": dict(self.reasoning)})]

    def _text(self, delta: str) -> None:
        self._close_reasoning("completed")
        if self.message is None:
            self.message = message_item(f"msg_{uuid.uuid4().hex}")
            self.items.append(self.message)
            self.text = ""
            self.events.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                                "item": dict(self.message)}))
            self.events.append(("response.content_part.added", {**self._where(self.message["id"]), "content_index": 0,
                                                                 "part": text_part("")}))
        if not delta:
            return
        self.text += delta
        self.events.append(("response.output_text.delta", {**self._where(self.message["id"]), "content_index": 0,
                                                            "delta": delta, "logprobs": []}))

    def _call(self, call: dict) -> None:
        """A tool call's delta: a new call (with its id and name), or more of its arguments."""
        function = call.get("function", {})
        item = self.calls.get(call["index"])
        if item is None:
            self._close_reasoning("completed")
            self._close_message("completed")
            item = self.calls[call["index"]] = call_item(f"fc_{uuid.uuid4().hex}", call["id"], function["name"], "",
                                                         "in_progress")
            self.items.append(item)
            self.events.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                                "item": dict(item)}))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            self.events.append(("response.function_call_arguments.delta", {**self._where(item["id"]),
                                                                            "delta": function["arguments"]}))

    def _close_message(self, status: str) -> None:
        if self.message is None:
            return
        where, part = self._where(self.message["id"]), text_part(self.text)
        self.message.update(status=status, content=[part])
        self.events += [("response.output_text.done", {**where, "content_index": 0, "text": self.text,
                                                        "logprobs": []}),
                        ("response.content_part.done", {**where, "content_index": 0, "part": part}),
                        ("response.output_item.done", {"output_index": where["output_index"],
                                                        "item": dict(self.message)})]
        self.message = None

    def close(self, reason: str | None) -> None:
        """The output is complete: every open item is done ("incomplete" if cut short)."""
        status = "incomplete" if reason == "length" else "completed"
        if not self.items:  # (nothing written: an empty message, as OpenAI's answer has one)
            self._text("")
        self._close_reasoning(status)
        self._close_message(status)
        for item in self.calls.values():
            if item["status"] == "in_progress":
                item["status"] = status
                where = self._where(item["id"])
                self.events += [("response.function_call_arguments.done", {**where, "name": item["name"],
                                                                            "arguments": item["arguments"]}),
                                ("response.output_item.done", {"output_index": where["output_index"],
                                                                "item": dict(item)})]


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def finished(shell: dict, items: ResponseItems, output: RequestOutput) -> dict:
    """The whole response, its request finished and its items closed."""
    cut = output.outputs[0].finish_reason == "length"
    prompt, generated = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    reasoning = items.reasoning_tokens(output.outputs[0].token_ids)
    return {**shell, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "output": items.items,
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                      "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning},
                      "total_tokens": prompt + generated}}


def event(kind: str, data: dict, number: int) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **data})}\n\n"


async def response_events(outputs: list, shell: dict, items: ResponseItems):
    """A streamed response's events; closing this aborts the request, as for a chat stream."""
    count = iter(range(1 << 62))
    running = {**shell, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", {"response": running}, next(count))
    yield event("response.in_progress", {"response": running}, next(count))
    last = None
    async with aclosing(merged(outputs)) as stream:
        try:
            async for _, output in stream:
                last = output
                items.update(output.outputs[0].text, output.outputs[0].finish_reason)
                if items.events:
                    yield "".join(event(kind, data, next(count)) for kind, data in items.events)
                    items.events.clear()
        except (RequestFailedError, EngineDeadError) as e:
            failed = {**running, "status": "failed", "error": {"code": "server_error", "message": str(e)}}
            yield event("response.failed", {"response": failed}, next(count))
            return
    items.close(last.outputs[0].finish_reason)
    done = "".join(event(kind, data, next(count)) for kind, data in items.events)
    # "completed" even when max_output_tokens cut it (the response's status says so), as vLLM
    # sends it: the openai SDK's stream helper waits for this event to give the final response.
    yield done + event("response.completed", {"response": finished(shell, items, last)}, next(count))
