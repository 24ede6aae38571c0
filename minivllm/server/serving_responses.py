"""POST /v1/responses: OpenAI's Responses API for text, on the chat route's checks and engine.

The request becomes a chat completion (``ResponsesRequest.chat_request``: ``instructions`` as
a system message, then the input's messages), and the answer is reshaped: one ``message``
output item holding one ``output_text`` part, ``usage`` in input and output tokens, and
``status`` "incomplete" when ``max_output_tokens`` cut it short. Streamed, it is OpenAI's
event sequence (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``, whose response's status may be "incomplete"), each event named on
an ``event:`` line as OpenAI's and vLLM's are.
"""
import json
import uuid
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import Response

from minivllm.outputs import RequestOutput
from minivllm.server.async_engine import EngineDeadError, RequestFailedError
from minivllm.server.protocol import ResponsesRequest, now
from minivllm.server.serving_engine import OpenAIServingGeneration
from minivllm.server.streaming import EventStream, final_outputs, merged


class OpenAIServingResponses(OpenAIServingGeneration):
    async def create_response(self, body: ResponsesRequest, request: Request):
        chat = body.chat_request()
        params = self.sampling_params(chat)
        ids, text = self.truncate(*await self.encode_messages(chat), params)
        self.check_prompt(ids, params, "input", body=chat)
        response_id = f"resp_{uuid.uuid4().hex}"
        await self.compile_grammar(params, chat, request)  # text.format's schema, a 400 if it does not compile
        outputs = self.start([(ids, text)], params, response_id, request)
        shell = {"id": response_id, "object": "response", "created_at": now(), "model": self.model_name,
                 "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                 "temperature": params.temperature, "top_p": params.top_p, "tools": [], "tool_choice": "auto",
                 "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "metadata": body.metadata or {},
                 "error": None, "incomplete_details": None, "user": body.user}
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return EventStream(response_events(outputs, shell, message_id))
        finals = await final_outputs(outputs, request)
        if finals is None:
            return Response(status_code=499)  # the client left; nobody reads this
        return finished(shell, message_id, finals[0])


def message_item(message_id: str, text: str, status: str) -> dict:
    """The response's one output item; it holds its text part once the text is complete."""
    content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                   "logprobs": []}]
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def finished(shell: dict, message_id: str, output: RequestOutput) -> dict:
    """The whole response, its request finished."""
    c = output.outputs[0]
    cut = c.finish_reason == "length"
    prompt, generated = len(output.prompt_token_ids), len(c.token_ids)
    return {**shell, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": [message_item(message_id, c.text, "incomplete" if cut else "completed")],
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                      "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + generated}}


def event(kind: str, data: dict, number: int) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **data})}\n\n"


async def response_events(outputs: list, shell: dict, message_id: str):
    """A streamed response's events; closing this aborts the request, as for a chat stream."""
    count = iter(range(1 << 62))
    part = {"item_id": message_id, "output_index": 0, "content_index": 0}
    running = {**shell, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", {"response": running}, next(count))
    yield event("response.in_progress", {"response": running}, next(count))
    yield event("response.output_item.added", {"output_index": 0, "item": message_item(message_id, "", "in_progress")},
                next(count))
    yield event("response.content_part.added",
                {**part, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}, next(count))
    sent, last = 0, None
    async with aclosing(merged(outputs)) as stream:
        try:
            async for _, output in stream:
                text, last = output.outputs[0].text, output
                if len(text) > sent:
                    yield event("response.output_text.delta", {**part, "delta": text[sent:], "logprobs": []},
                                next(count))
                    sent = len(text)
        except (RequestFailedError, EngineDeadError) as e:
            failed = {**running, "status": "failed", "error": {"code": "server_error", "message": str(e)}}
            yield event("response.failed", {"response": failed}, next(count))
            return
    whole = finished(shell, message_id, last)
    item = whole["output"][0]
    yield event("response.output_text.done", {**part, "text": item["content"][0]["text"], "logprobs": []}, next(count))
    yield event("response.content_part.done", {**part, "part": item["content"][0]}, next(count))
    yield event("response.output_item.done", {"output_index": 0, "item": item}, next(count))
    # "completed" even when max_output_tokens cut it (the response's status says so), as vLLM
    # sends it: the openai SDK's stream helper waits for this event to give the final response.
    yield event("response.completed", {"response": whole}, next(count))
