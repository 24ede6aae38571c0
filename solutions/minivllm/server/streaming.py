# Reference copy of minivllm/server/streaming.py, generated from it by scripts/make_exercises.py.
# Reference answers for: sse_event (ch14), stream_events (ch14).
# Do not edit: change minivllm/server/streaming.py and run scripts/make_exercises.py again.

"""Server-sent events, and the outputs of a request's prompts merged into one stream.

With ``stream: true`` the answer is one ``data: {json}`` event per engine step that gave a
prompt of the request a token (its choice carries the prompt's ``index``), then
``data: [DONE]``. A client that disconnects mid-stream closes the event generator, which
aborts the request and frees its KV blocks; a non-streaming request is watched for a
disconnect too (``final_outputs``). A stream the engine cannot finish ends with an
``{"error": ...}`` event, then ``[DONE]``.
"""
import asyncio
import json
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import StreamingResponse

from minivllm.outputs import RequestOutput
from minivllm.server.async_engine import EngineDeadError, RequestFailedError
from minivllm.server.protocol import APIError, usage


def sse_event(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that closes its generator however the response ends
    (finished, client gone, error), so the request behind it is aborted at once rather than
    when the garbage collector gets to it."""

    def __init__(self, events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def merged(outputs: list):
    """``(index, output)`` from several requests' outputs, as each arrives. Closing this
    closes every one of them (which aborts those not finished); an error of one (the engine
    failed it, or died) is raised here, and the others are closed too.

    A request's outputs are cumulative (each holds all its text so far), so when several of
    one request have queued up while the reader was busy (a server behind its streams, under
    load), only the newest is handed on: one event carries all their tokens, and the server
    catches up instead of writing an event per step it is behind (vLLM merges a lagging
    stream's outputs the same way). The engines' own queues do that for each request
    (``OutputQueue``), so one request's outputs are read directly, with no task between."""
    if len(outputs) == 1:
        async with aclosing(outputs[0]) as one:
            async for output in one:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(i, one):
        try:
            async with aclosing(one):
                async for output in one:
                    queue.put_nowait((i, output))
        except Exception as e:  # handed to the reader, who raises it
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, finished))

    tasks = [asyncio.ensure_future(pump(i, one)) for i, one in enumerate(outputs)]
    try:
        remaining = len(tasks)
        while remaining:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            newest = {i: k for k, (i, item) in enumerate(batch) if item is not finished and not isinstance(item, Exception)}
            for k, (i, item) in enumerate(batch):
                if item is finished:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                elif newest[i] == k:
                    yield i, item
    finally:
        for task in tasks:
            task.cancel()  # a request still running: cancelling its wait aborts it
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_events(outputs: list, head: dict, choice, stream_options, first: list | None = None, n: int = 1,
                        usage=usage):
    """The SSE events of one streaming request: a chunk per output of each of its prompts,
    with a choice for each completion that moved (the text and tokens new since its last
    chunk, under index prompt * n + completion), the usage if asked for (``usage``: what
    counts it from the last outputs; a chat with a reasoning parser counts the reasoning's
    tokens too), then [DONE]. If the engine fails the request, or dies, the stream says so
    in an error event before its [DONE].

    The last chunk, the usage and [DONE] go in one write: each write is a system call and a
    packet, and a request's stream is a few of them per token at most."""
    include_usage = stream_options is not None and stream_options.include_usage
    async with aclosing(merged(outputs)) as events:  # leaving early closes them: the requests are aborted
        if first is not None:
            # Once the first token is there, not before the prefill: a client times its first
            # token from the first chunk (vLLM's benchmark does), and that is what it measures.
            events = await first_arrived(events)
            yield sse_event({**head, "choices": first})
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        ended: set[int] = set()  # choices whose finish_reason has been sent
        last: list[RequestOutput | None] = [None] * len(outputs)
        num_finished = 0
        try:
            async for i, output in events:
                choices = []
                for c in output.outputs:  # with n > 1, only the completions that moved
                    index = i * n + c.index
                    text_sent, tokens_sent = sent.get(index, (0, 0))
                    if len(c.token_ids) > tokens_sent or (c.finish_reason is not None and index not in ended):
                        choices.append(choice(index, output, c, text_sent, tokens_sent))
                        sent[index] = (len(c.text), len(c.token_ids))
                        if c.finish_reason is not None:
                            ended.add(index)
                last[i] = output
                num_finished += output.finished
                event = sse_event({**head, "choices": choices}) if choices else ""
                if num_finished == len(outputs):  # every prompt's last output: the stream's end follows
                    if include_usage:
                        event += sse_event({**head, "choices": [], "usage": usage(*last)})
                    yield event + DONE_EVENT
                    return
                if event:
                    yield event
        except RequestFailedError as e:
            yield sse_event(APIError(500, f"the engine failed this request ({e}); other requests are unaffected",
                                     type="server_error").body())
            yield DONE_EVENT
            return
        except EngineDeadError as e:
            yield sse_event(APIError(503, str(e), type="server_error").body())
            yield DONE_EVENT
            return
        # (the outputs ended without a finished one: not from an engine, but said the same way)
        if include_usage and all(o is not None for o in last):
            yield sse_event({**head, "choices": [], "usage": usage(*last)})
        yield DONE_EVENT


async def first_arrived(events):
    """``events`` (async, not yet started) once its first item has arrived: that item, then
    the rest. If it ends or fails first, the returned generator does the same when read."""
    try:
        item = await anext(events)
    except StopAsyncIteration:
        return resumed((), None, events)
    except Exception as e:  # the engine failed the request, or died: told where the stream tells it
        return resumed((), e, events)
    return resumed((item,), None, events)


async def resumed(items: tuple, error: Exception | None, events):
    for item in items:
        yield item
    if error is not None:
        raise error
    async for item in events:
        yield item


async def final_outputs(outputs: list, request: Request, poll_s: float = 0.5) -> list[RequestOutput] | None:
    """Run a non-streaming request's prompts to their end; if the client disconnects first,
    abort them and return None."""

    async def last():
        finals: list[RequestOutput | None] = [None] * len(outputs)
        async with aclosing(merged(outputs)) as events:
            async for i, output in events:
                finals[i] = output
        return finals

    task = asyncio.ensure_future(last())
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()  # cancels the waits inside generate(), whose cleanup aborts the requests
            await asyncio.gather(task, return_exceptions=True)
            return None
