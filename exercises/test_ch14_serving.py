"""Chapter 14 — serving: the SSE framing, request fields to SamplingParams, the loop's
routing of outputs, and the abort when a caller leaves.

Your ``sse_event`` (exercises/minivllm/server/api.py) must frame one event exactly as
server-sent events want it, so that a stream of them splits back into the same payloads.
Your ``to_sampling_params`` (exercises/minivllm/server/protocol.py) must carry every field
across, with SamplingParams' defaults where the request left a field out, for completions
and chat alike; bad values must come back as 400s naming the field. Your ``_dispatch`` and
the abort in ``generate`` (exercises/minivllm/server/async_engine.py) are checked on a tiny
model: concurrent callers get exactly the offline engine's tokens, and a caller that stops
early (closes its iterator, or is cancelled, even twice) leaves the KV pool entirely free.
The loop of ``generate`` is checked on outputs the test puts in the request's queue itself:
each one in order and nothing after the finished one, a failed request raised, the engine's
death raised, and no abort owed after any of them.

The main exercise is the streaming handler, ``stream_events``
(exercises/minivllm/server/streaming.py), driven here by fake cumulative outputs: each event
carries only what is new, a finish without a new token is sent once, choices of n
completions and several prompts keep their own indexes, the last chunk, the usage and
[DONE] go in one write, and a failed request or a dead engine ends the stream with an
error event before [DONE].
"""
import asyncio
import json
import threading

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.server.api import sse_event
from minivllm.server.async_engine import AsyncLLMEngine
from minivllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request, to_sampling_params
from minivllm.testing import torch_threads

# --- the SSE framing ------------------------------------------------------------------


def parse_stream(raw: str) -> list:
    """What an SSE client does: events end at a blank line; each has one 'data: ' line."""
    assert raw.endswith("\n\n"), "every event ends with a blank line: the text must end with two newlines"
    events = raw.split("\n\n")[:-1]
    payloads = []
    for event in events:
        assert event.startswith("data: "), f"an event is a line 'data: <json>', got {event[:60]!r}"
        assert "\n" not in event, f"one event is one line (JSON escapes newlines in strings), got {event!r}"
        payloads.append(json.loads(event[len("data: "):]))
    return payloads


def test_ch14_sse_event_is_one_data_line_and_a_blank_line():
    payload = {"id": "cmpl-1", "choices": [{"index": 0, "text": "two\nlines", "finish_reason": None}]}
    event = sse_event(payload)
    assert isinstance(event, str), f"sse_event returns the event as a str, got {type(event).__name__}"
    assert event.startswith("data: ") and event.endswith("\n\n"), f"expected 'data: {{json}}\\n\\n', got {event!r}"
    assert event.count("\n") == 2, f"the only newlines are the two that end the event, got {event!r}"
    assert json.loads(event[len("data: "):-2]) == payload


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=50)
@given(st.lists(st.dictionaries(st.text(max_size=8), json_values, max_size=4), min_size=1, max_size=5))
def test_ch14_a_stream_of_events_splits_back_into_its_payloads(payloads):
    raw = "".join(sse_event(p) for p in payloads)
    assert parse_stream(raw) == payloads


# --- request fields to SamplingParams -------------------------------------------------


def completion(**fields) -> CompletionRequest:
    return parse_request(json.dumps({"model": "m", "prompt": "hi", **fields}).encode(), CompletionRequest)


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def fields_of(params: SamplingParams) -> dict:
    assert isinstance(params, SamplingParams), f"to_sampling_params returns SamplingParams, got {type(params).__name__}"
    names = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids",
             "ignore_eos", "logprobs", "skip_special_tokens")
    return {name: getattr(params, name) for name in names}


DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, min_tokens=0, stop=[], stop_token_ids=[],
                ignore_eos=False, logprobs=None, skip_special_tokens=True)


def test_ch14_fields_left_out_take_the_defaults():
    assert fields_of(to_sampling_params(completion())) == {**DEFAULTS, "max_tokens": 16}, (
        "a completion that sets nothing: SamplingParams' defaults, and OpenAI's max_tokens default of 16"
    )
    assert fields_of(to_sampling_params(chat())) == {**DEFAULTS, "max_tokens": None}, (
        "a chat that sets nothing: SamplingParams' defaults, and no max_tokens (until the context is full)"
    )
    nulls = dict(temperature=None, top_p=None, top_k=None, min_p=None)
    assert fields_of(to_sampling_params(completion(**nulls))) == {**DEFAULTS, "max_tokens": 16}, (
        "an explicit null takes the default too"
    )


def test_ch14_chat_logprobs_and_max_completion_tokens():
    assert to_sampling_params(chat(logprobs=True)).logprobs == 0, "logprobs=true alone: the chosen token's only (0)"
    assert to_sampling_params(chat(logprobs=True, top_logprobs=4)).logprobs == 4
    assert to_sampling_params(chat(logprobs=False)).logprobs is None
    assert to_sampling_params(chat(max_tokens=9, max_completion_tokens=5)).max_tokens == 5, (
        "max_completion_tokens is the newer name and wins over max_tokens"
    )


@settings(max_examples=60)
@given(
    temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.integers(0, 50), min_p=st.floats(0, 1),
    seed=st.none() | st.integers(0, 2**31), max_tokens=st.integers(1, 200), min_tokens=st.integers(0, 1),
    stop=st.none() | st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3), ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20), skip_special_tokens=st.booleans(),
)
def test_ch14_every_field_is_carried_across(**fields):
    params = to_sampling_params(completion(**fields))
    expected = {**fields, "stop": [fields["stop"]] if isinstance(fields["stop"], str) else list(fields["stop"] or [])}
    assert fields_of(params) == expected


@pytest.mark.parametrize("request_fields, param", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=3, min_tokens=4), "min_tokens"), (dict(stop=[""]), "stop"),
])
def test_ch14_bad_values_are_400s_naming_the_field(request_fields, param):
    with pytest.raises(APIError) as error:
        to_sampling_params(completion(**request_fields))
    assert error.value.status == 400 and error.value.param == param, (
        f"{request_fields}: expected a 400 naming {param!r}, got {error.value.status} naming {error.value.param!r}"
    )


# --- the loop and the abort -----------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with torch_threads(1):
        yield LLM(str(tiny_qwen3), num_kv_blocks=128, block_size=8, max_num_seqs=16)


def output(request_id: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "", list(range(n)))], finished=finished)


def test_ch14_dispatch_routes_each_output_to_its_queue(llm):
    engine = AsyncLLMEngine(llm.engine)
    engine._queues = {"a": asyncio.Queue(), "b": asyncio.Queue()}
    outputs = [output("a", 1), output("b", 1), output("gone", 3), output("a", 2, finished=True)]
    engine._dispatch(outputs)
    a = [engine._queues["a"].get_nowait() for _ in range(engine._queues["a"].qsize())]
    b = [engine._queues["b"].get_nowait() for _ in range(engine._queues["b"].qsize())]
    assert a == [outputs[0], outputs[3]], "queue 'a' must get a's outputs, in order"
    assert b == [outputs[1]], "queue 'b' must get b's output"


async def until_idle(engine: AsyncLLMEngine, timeout: float = 20.0) -> None:
    bm = engine.engine.block_manager
    for _ in range(int(timeout / 0.01)):
        if not engine.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"after {timeout} s: {bm.num_free_blocks} of {bm.num_blocks} blocks free, "
                f"requests still in the engine: {engine.engine.has_unfinished_requests()}")


def test_ch14_concurrent_callers_get_the_offline_tokens(llm):
    prompts = [[5, 17, 301, 42], [9, 8, 7, 6, 5, 4, 3], [400, 3], [11] * 13]
    lengths = [12, 5, 9, 7]
    with torch_threads(1):
        offline = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
                               use_tqdm=False)

    async def one(engine, prompt, n):
        seen = []
        async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
            seen.append(out)
        return seen

    async def run():
        engine = AsyncLLMEngine(llm.engine)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(engine, p, n) for p, n in zip(prompts, lengths))), 60)
        finally:
            await engine.shutdown()

    with torch_threads(1):
        streams = asyncio.run(run())
    for i, (seen, want) in enumerate(zip(streams, offline)):
        assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, lengths[i] + 1)), (
            f"request {i}: one output per step, each one token longer"
        )
        assert seen[-1].finished and not any(o.finished for o in seen[:-1])
        assert seen[-1].outputs[0].token_ids == want.outputs[0].token_ids, f"request {i} differs from the offline run"


def test_ch14_a_caller_that_leaves_frees_its_blocks(llm):
    async def run():
        engine = AsyncLLMEngine(llm.engine)
        try:
            long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
            # 1. Stop iterating after two outputs and close the iterator.
            stream = engine.generate([5, 6, 7, 8, 9], long)
            for _ in range(2):
                await stream.__anext__()
            await stream.aclose()
            await until_idle(engine)
            assert engine.num_aborted == 1, "closing the iterator early must abort the request"

            # 2. A caller cancelled while it waits for its next token.
            async def consume():
                async for _ in engine.generate([1, 2, 3, 4], long):
                    pass

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until_idle(engine)
            assert engine.num_aborted == 2, "a cancelled caller must abort its request"

            # 3. A request that runs to the end is not aborted, and the engine still serves.
            outs = [o async for o in engine.generate([3, 4], SamplingParams(temperature=0, max_tokens=3))]
            assert outs[-1].finished and engine.num_aborted == 2
            await until_idle(engine)
        finally:
            await engine.shutdown()

    with torch_threads(1):
        asyncio.run(run())


def test_ch14_a_caller_cancelled_twice_still_frees_its_blocks(llm):
    """A task cancelled again while its finally runs (a server shutting down, a timeout on
    top of a disconnect) must still abort its request: the abort is queued for the engine
    thread, not awaited, or the second cancel takes it off the queue before it runs."""

    async def run():
        engine = AsyncLLMEngine(llm.engine)
        gate = threading.Event()
        try:
            long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

            async def consume():
                async for _ in engine.generate([1, 2, 3, 4], long):
                    pass

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.2)  # streaming by now
            # Hold the engine thread, as a long step would: a job queued now waits its turn.
            engine._executor.submit(gate.wait, 30)
            task.cancel()
            await asyncio.sleep(0)  # the caller runs its finally...
            task.cancel()  # ...and is cancelled again meanwhile
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            await until_idle(engine)
            assert engine.num_aborted == 1, (
                "a caller cancelled twice must still abort its request (its blocks came back only "
                "because it ran to the end): queue the abort with self._executor.submit, do not await it"
            )
        finally:
            gate.set()
            await engine.shutdown()

    with torch_threads(1):
        asyncio.run(run())


# --- the streaming handler ------------------------------------------------------------


def _out(text, tokens, finish=None, index=0, prompt=(1, 2, 3), cached=0):
    return CompletionOutput(index=index, text=text, token_ids=list(tokens), finish_reason=finish)


def _request(*completions, finished=False, prompt=(1, 2, 3), cached=0):
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=list(prompt), outputs=list(completions),
                         finished=finished, num_cached_tokens=cached)


async def _outputs(items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        await asyncio.sleep(0)
        yield item


def _choice(index, output, c, text_sent, tokens_sent):
    """A minimal choice: what is new since the counts sent."""
    return {"index": index, "text": c.text[text_sent:], "tokens": c.token_ids[tokens_sent:],
            "finish_reason": c.finish_reason}


class _Options:
    def __init__(self, include_usage):
        self.include_usage = include_usage


def run_stream(streams, include_usage=None, n=1, first=None) -> list[str]:
    """The raw writes of stream_events over fake outputs, one string per write."""
    from minivllm.server.streaming import stream_events

    options = None if include_usage is None else _Options(include_usage)

    async def collect():
        writes = []
        gen = stream_events([_outputs(s) for s in streams], {"id": "x"}, _choice, options, first=first, n=n)
        async for w in gen:
            writes.append(w)
        return writes

    return asyncio.run(collect())


def payloads_of(writes):
    out = []
    for w in writes:
        for event in w.split("\n\n")[:-1]:
            body = event[len("data: "):]
            out.append(body if body == "[DONE]" else json.loads(body))
    return out


def test_ch14_stream_sends_only_what_is_new():
    stream = [_request(_out("He", [1])), _request(_out("Hello", [1, 2])),
              _request(_out("Hello world", [1, 2, 3], "stop"), finished=True)]
    events = payloads_of(run_stream([stream]))
    assert events[-1] == "[DONE]", "the stream ends with [DONE]"
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["He", "llo", " world"], f"each event carries the text new since the last one, got {texts}"
    tokens = [e["choices"][0]["tokens"] for e in events[:-1]]
    assert tokens == [[1], [2], [3]], f"and only the new tokens, got {tokens}"
    assert events[-2]["choices"][0]["finish_reason"] == "stop", "the last chunk carries the finish_reason"
    assert all(e["id"] == "x" for e in events[:-1]), "every chunk carries the head's fields"


def test_ch14_last_chunk_usage_and_done_go_in_one_write():
    stream = [_request(_out("a", [5])), _request(_out("ab", [5, 6], "length"), finished=True, cached=2)]
    writes = run_stream([stream], include_usage=True)
    assert len(writes) == 2, f"one write per output, the last holding the end of the stream: got {len(writes)} writes"
    last = payloads_of(writes[-1:])
    assert len(last) == 3 and last[-1] == "[DONE]", "the last write: the last chunk, the usage, then [DONE]"
    assert last[1]["choices"] == [] and last[1]["usage"]["completion_tokens"] == 2, (
        "the usage event has no choices and counts every completion token")
    assert last[1]["usage"]["prompt_tokens"] == 3 and last[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert "usage" not in json.dumps(payloads_of(run_stream([stream], include_usage=False))[:-1]), (
        "no usage event unless stream_options asks for it")
    assert "usage" not in json.dumps(payloads_of(run_stream([stream]))[:-1]), "no stream_options: no usage event"


def test_ch14_a_finish_without_a_new_token_is_sent_once():
    stream = [_request(_out("ab", [1, 2])), _request(_out("ab", [1, 2])),
              _request(_out("ab", [1, 2], "stop"), finished=True)]
    events = payloads_of(run_stream([stream]))
    assert len(events) == 3, f"an output with nothing new sends no event; its finish does: got {events}"
    assert events[1]["choices"] == [{"index": 0, "text": "", "tokens": [], "finish_reason": "stop"}], (
        "a completion that finished without a new token still gets its chunk, with the finish_reason")


def test_ch14_n_completions_and_several_prompts_get_their_own_indexes():
    a = [_request(_out("x", [1], index=0), _out("y", [2], index=1)),
         _request(_out("x", [1], "stop", index=0), _out("yz", [2, 3], index=1)),
         _request(_out("x", [1], "stop", index=0), _out("yz!", [2, 3, 4], "stop", index=1), finished=True)]
    b = [_request(_out("p", [9], index=0), _out("q", [8], "stop", index=1)),
         _request(_out("pp", [9, 9], "stop", index=0), _out("q", [8], "stop", index=1), finished=True)]
    events = payloads_of(run_stream([a, b], n=2, include_usage=True))
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 3 + 1 + 2 + 1, (
        "the usage sums the last output of every prompt")
    by_index: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for e in events[:-2]:
        assert e["choices"], "no event without a choice"
        for c in e["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
            finishes[c["index"]] = finishes.get(c["index"], 0) + (c["finish_reason"] is not None)
    assert by_index == {0: "x", 1: "yz!", 2: "pp", 3: "q"}, f"choice index = prompt * n + completion, got {by_index}"
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}, f"each choice's finish_reason is sent exactly once, got {finishes}"


def test_ch14_a_failed_request_ends_with_an_error_event():
    from minivllm.server.async_engine import EngineDeadError, RequestFailedError

    stream = [_request(_out("a", [1])), RequestFailedError("boom")]
    events = payloads_of(run_stream([stream]))
    assert events[-1] == "[DONE]", "an error event is still followed by [DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "boom" in error["message"], (
        "a request the engine failed ends with an error event of type server_error naming the failure")
    events = payloads_of(run_stream([[EngineDeadError("engine died")]]))
    assert events[-2]["error"]["message"] == "engine died" and events[-1] == "[DONE]", (
        "a dead engine ends the stream with its message, then [DONE]")


def test_ch14_outputs_that_run_out_still_end_the_stream():
    stream = [_request(_out("a", [1])), _request(_out("ab", [1, 2]))]
    events = payloads_of(run_stream([stream], include_usage=True))
    assert events[-1] == "[DONE]", "outputs that end without a finished one still end with [DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 2, "with the usage of the last outputs, when asked"
    assert payloads_of(run_stream([[]], include_usage=True)) == ["[DONE]"], (
        "no output at all: no usage to give, only [DONE]")
    first = payloads_of(run_stream([stream], first=[{"index": 0, "role": "assistant"}]))
    assert first[0]["choices"] == [{"index": 0, "role": "assistant"}], "the first chunk given goes out first"


# --- the caller's side of the queue: generate's loop ---------------------------------------


def _quiet(llm, monkeypatch):
    """An AsyncLLMEngine whose engine takes requests in but never runs them, and records the
    aborts it is asked for: the test puts each output in the request's queue itself."""
    aborted = []
    monkeypatch.setattr(llm.engine, "add_request", lambda *args, **kwargs: None)
    monkeypatch.setattr(llm.engine, "abort_request", lambda request_id: aborted.append(request_id) or True)
    return AsyncLLMEngine(llm.engine), aborted


async def _next_after(engine, stream, request_id, item):
    """Ask the stream for its next output, put ``item`` in the request's queue once the
    stream waits on it, and return what the stream gives (or raises)."""
    waiting = asyncio.ensure_future(stream.__anext__())
    for _ in range(2000):
        if request_id in engine._queues or waiting.done():
            break
        await asyncio.sleep(0.005)
    if isinstance(item, BaseException):
        engine._fail_all(item)
    elif item is not None:
        engine._dispatch([item])
    return await asyncio.wait_for(waiting, 10)


def failed(request_id: str, error: str) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "", [])], finished=True, error=error)


def test_ch14_generate_yields_each_output_and_ends_after_the_finished_one(llm, monkeypatch):
    async def run():
        engine, aborted = _quiet(llm, monkeypatch)
        try:
            stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=3), request_id="r")
            sent = [output("r", 1), output("r", 2), output("r", 3, finished=True)]
            got = [await _next_after(engine, stream, "r", out) for out in sent]
            assert got == sent, "the caller must get each output of its request, in order"
            try:
                await asyncio.wait_for(stream.__anext__(), 5)
            except StopAsyncIteration:
                pass
            except asyncio.TimeoutError:
                pytest.fail("the stream must end after the output that says the request finished, not wait for more")
            else:
                pytest.fail("nothing may come after the finished output")
            await asyncio.sleep(0.1)
            assert aborted == [], "a request that finished has nothing to abort"
        finally:
            await engine.shutdown()

    with torch_threads(1):
        asyncio.run(run())


def test_ch14_a_request_the_engine_failed_raises_and_is_not_aborted(llm, monkeypatch):
    from minivllm.server.async_engine import RequestFailedError

    async def run():
        engine, aborted = _quiet(llm, monkeypatch)
        try:
            stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=3), request_id="f")
            assert await _next_after(engine, stream, "f", output("f", 1)) is not None
            with pytest.raises(RequestFailedError, match="grammar exploded"):
                await _next_after(engine, stream, "f", failed("f", "grammar exploded"))
            await asyncio.sleep(0.1)
            assert aborted == [], "the engine already ended a request it failed: nothing to abort"
        finally:
            await engine.shutdown()

    with torch_threads(1):
        asyncio.run(run())


def test_ch14_the_engine_dying_mid_stream_reaches_the_caller(llm, monkeypatch):
    from minivllm.server.async_engine import EngineDeadError

    async def run():
        engine, aborted = _quiet(llm, monkeypatch)
        try:
            stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=3), request_id="d")
            await _next_after(engine, stream, "d", output("d", 1))
            with pytest.raises(EngineDeadError, match="device fell over"):
                await _next_after(engine, stream, "d", EngineDeadError("device fell over"))
            await asyncio.sleep(0.1)
            assert aborted == [], "a dead engine has nothing left to abort"
        finally:
            await engine.shutdown()

    with torch_threads(1):
        asyncio.run(run())
