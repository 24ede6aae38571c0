# Exercise copy of minivllm/server/streaming.py, generated from it by scripts/make_exercises.py.
# Fill in: sse_event (ch14), stream_events (ch14).
# Grade: make grade CH=14
# Running the generator again overwrites this file: commit or copy your work first.

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
    raise NotImplementedError(
        "ch14: frame one server-sent event: a data field (the field name data, a colon and a "
        "space) holding data as JSON, then the blank line that ends an event, so the frame ends "
        "with two newlines. Pitfall: the framing is line based: the JSON must not hold a raw "
        "newline, which the JSON encoder's compact output never does (it escapes them inside "
        "strings), see notebooks/14_serving.ipynb"
    )


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
        raise NotImplementedError(
            "ch14: stream_events (the streaming handler): outputs arrive cumulative (each holds a "
            "completion's whole text and tokens so far), as (prompt i, output) pairs from merged; "
            "a client wants only what is new. Remember, per choice index (prompt i times n plus "
            "the completion's own index), how many characters and tokens were already sent, and "
            "build a choice (with the given choice function) only for completions that gained a "
            "token, or that just finished and whose finish_reason was not yet sent. One event per "
            "output with any choice, none for an output with none. When every prompt has given its "
            "finished output, that event, the usage event (only when stream_options asks for it, "
            "over the last output of every prompt, with no choices) and the final [DONE] go out as "
            "one string, and the stream ends. A request the engine failed (RequestFailedError) "
            "ends the stream with an error event, a 500 of type server_error, then [DONE]; a dead "
            "engine (EngineDeadError) likewise with a 503. Outputs that run out without a finished "
            "one end with the usage (if asked, and every prompt gave an output) and [DONE]. "
            "Pitfall: a finished completion with no new token still needs its chunk, once, see "
            "notebooks/14_serving.ipynb"
        )


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
