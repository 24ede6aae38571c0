"""Streams when the server is behind them: what a client reads is unchanged.

A request's outputs are cumulative, so a server that was busy while several of them
arrived sends the newest only (``OutputQueue``), and one event carries several tokens. That
must change nothing a client can add up: the concatenated text, the finish reason, the
logprobs (one entry per token, in order), the usage, every chunk's id, object, created and
model, and one [DONE] at the very end. Here the server's event loop is stalled on purpose
while the engine core (its own process) goes on stepping, so that outputs do pile up.
"""
import asyncio
import json
import threading
import time

import httpx
import pytest

from minivllm import SamplingParams
from minivllm.server.api import ServerConfig
from minivllm.server.async_engine import OutputQueue
from minivllm.server.engine_client import EngineCoreClient
from minivllm.testing import torch_threads
from shared import SERVED_ENGINE, SERVED_MODEL, offline_engine, served_checkpoint, threaded_server

MODEL, ENGINE = SERVED_MODEL, SERVED_ENGINE
PROMPTS = ["The quick brown fox", "Hello, world! How are", "Prefix caching lets requests", "It was the best of"]


def test_an_output_queue_holds_the_newest_output_and_then_the_error():
    async def run():
        queue = OutputQueue()
        for k in range(3):  # the reader is busy: three outputs arrive
            queue.put_nowait(f"output {k}")  # (stands for a cumulative RequestOutput)
        behind = await queue.get()
        waiting = asyncio.ensure_future(queue.get())  # the reader keeps up: it waits for the next
        await asyncio.sleep(0)
        assert not waiting.done()
        queue.put_nowait("output 3")
        kept_up = await waiting
        queue.put_nowait("output 4")
        queue.put_nowait(RuntimeError("the engine died"))
        return behind, kept_up, await queue.get(), await queue.get()

    behind, kept_up, last, error = asyncio.run(run())
    assert (behind, kept_up, last) == ("output 2", "output 3", "output 4")
    assert isinstance(error, RuntimeError)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory, "streams")


@pytest.fixture(scope="module")
def offline(checkpoint):
    with offline_engine(checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(checkpoint):
    with torch_threads(1):
        client = EngineCoreClient(str(checkpoint), **ENGINE)
    with threaded_server(checkpoint, ServerConfig(), engine=client) as running:
        yield running


def stall(engine: EngineCoreClient, times: int, seconds: float, stop: threading.Event) -> None:
    """Block the server's event loop ``times`` times while requests are in flight (the core
    steps on meanwhile). Counting only stalls with requests open keeps them inside the
    streams on a slow or busy machine, where the requests may start late."""
    done = 0
    while done < times and not stop.wait(0.05):
        loop = engine._loop
        if loop is not None and engine._queues:
            loop.call_soon_threadsafe(time.sleep, seconds)
            done += 1


async def read_stream(client: httpx.AsyncClient, url: str, path: str, body: dict) -> list:
    """Every event's payload, [DONE] as the string."""
    payloads = []
    async with client.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def check_stream(payloads: list, obj: str) -> tuple[dict, list[dict], dict]:
    """The chunks' shared head, their choices' in order, and the usage; checks the frame."""
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    chunks = payloads[:-1]
    heads = {(c["id"], c["object"], c["created"], c["model"]) for c in chunks}
    assert len(heads) == 1 and chunks[0]["object"] == obj and chunks[0]["model"] == MODEL, heads
    assert chunks[-1]["choices"] == [] and all(c["choices"] for c in chunks[:-1]), "the usage chunk is last"
    assert all("usage" not in c or c["usage"] is None for c in chunks[:-1])
    return chunks[0], [ch for c in chunks[:-1] for ch in c["choices"]], chunks[-1]["usage"]


def test_streams_of_a_server_behind_them_add_up_to_the_offline_answers(server, offline):
    n_tokens = 40
    completions = [{"model": MODEL, "prompt": p, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
                    "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}} for p in PROMPTS * 4]
    stopped = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": n_tokens, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}}
    two = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
           "stream": True, "stream_options": {"include_usage": True}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello, world!"}], "max_tokens": 30,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with torch_threads(1):
        want = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True,
                                                        logprobs=1), use_tqdm=False)
        [want_stopped] = offline.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=n_tokens),
                                          use_tqdm=False)
        want_two = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    use_tqdm=False)
        [want_chat] = offline.chat([{"role": "user", "content": "Hello, world!"}],
                                   SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(read_stream(client, server.url, "/v1/completions", b) for b in completions),
                read_stream(client, server.url, "/v1/completions", stopped),
                read_stream(client, server.url, "/v1/completions", two),
                read_stream(client, server.url, "/v1/chat/completions", chat))

    stop = threading.Event()
    staller = threading.Thread(target=stall, args=(server.engine, 8, 0.15, stop))
    staller.start()
    try:
        *streams, got_stopped, got_two, got_chat = asyncio.run(run())
    finally:
        stop.set()
        staller.join()

    most_tokens_in_a_chunk = 0
    for k, payloads in enumerate(streams):
        w = want[k % len(PROMPTS)]
        head, choices, used = check_stream(payloads, "text_completion")
        assert "".join(c["text"] for c in choices) == w.outputs[0].text
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        logprobs = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
        assert len(tokens) == n_tokens
        assert logprobs == pytest.approx([e[t].logprob for t, e in zip(w.outputs[0].token_ids, w.outputs[0].logprobs)],
                                         abs=1e-5)
        offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert used == {"prompt_tokens": len(w.prompt_token_ids), "completion_tokens": n_tokens,
                        "total_tokens": len(w.prompt_token_ids) + n_tokens,
                        "prompt_tokens_details": {"cached_tokens": used["prompt_tokens_details"]["cached_tokens"]}}
        most_tokens_in_a_chunk = max(most_tokens_in_a_chunk, *(len(c["logprobs"]["tokens"]) for c in choices))
    assert most_tokens_in_a_chunk > 1, "no stream fell behind: the merging was not exercised"

    _, choices, used = check_stream(got_stopped, "text_completion")
    assert "".join(c["text"] for c in choices) == want_stopped.outputs[0].text
    assert choices[-1]["finish_reason"] == want_stopped.outputs[0].finish_reason
    assert used["completion_tokens"] == len(want_stopped.outputs[0].token_ids)

    _, choices, used = check_stream(got_two, "text_completion")
    for i, w in enumerate(want_two):
        mine = [c for c in choices if c["index"] == i]
        assert "".join(c["text"] for c in mine) == w.outputs[0].text and mine[-1]["finish_reason"] == "length"
    assert used["completion_tokens"] == 24 and used["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in want_two)

    _, choices, used = check_stream(got_chat, "chat.completion.chunk")
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"].get("content") or "" for c in choices) == want_chat.outputs[0].text
    assert choices[-1]["finish_reason"] == want_chat.outputs[0].finish_reason
    assert used["completion_tokens"] == len(want_chat.outputs[0].token_ids)
    assert used["prompt_tokens"] == len(want_chat.prompt_token_ids)


def test_the_benchmarks_load_from_two_processes_keeps_one_schedule(server):
    """``run_load_processes``: the requests dealt to two client processes still go at the
    times of one Poisson draw, from one start, and come back in the requests' order."""
    from minivllm.bench.serving import arrival_times, run_load_processes

    prompts = [[5 + i, 17, 301, 42] for i in range(8)]
    lens = [4 + i for i in range(8)]
    results, seconds, cpu = run_load_processes(server.url, MODEL, prompts, lens, rate=20.0, seed=1, processes=2)
    assert [r.error for r in results] == [None] * 8
    assert [r.output_tokens for r in results] == lens and [r.prompt_tokens for r in results] == [4] * 8
    times = arrival_times(8, 20.0, 1)
    assert all(t <= r.sent < t + 0.25 for t, r in zip(times, results)), [(t, r.sent) for t, r in zip(times, results)]
    assert seconds >= max(r.chunk_times[-1] for r in results) and cpu > 0
