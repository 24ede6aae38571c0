"""The engine core in a process of its own (``minivllm.server.engine_core`` and
``engine_client``): everything the in-thread engine does, through the process boundary.

The same requests through ``AsyncLLMEngine`` (in a thread of this process) and
``EngineCoreClient`` (a spawned core) give the same outputs, every streamed one of them
(those a caller behind them skips aside), field by field: greedy, seeded, n > 1, logprobs, stop strings. Over HTTP: the official
client's answers, clients that hang up free their blocks in the core, a request the engine
fails alone fails alone, /metrics reads the core's load. The core sends one message per
step, and a stream's bytes grow with its tokens, not with their square. When the core dies
(killed, or a step raised), every open stream ends with an error event and [DONE], /health
answers 503 and ``minivllm serve`` exits 1; when the server's process dies, the core exits.
"""
import asyncio
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.server import AsyncLLMEngine
from minivllm.server import serving_engine as api  # (where the requests' SamplingParams are made)
from minivllm.server.api import ServerConfig, ServerThread, build_app
from minivllm.server.async_engine import EngineDeadError
from minivllm.server.engine_client import EngineCoreClient
from minivllm.testing import ServeProcess, torch_threads
from shared import SERVED_ENGINE, SERVED_KEY, SERVED_MODEL, offline_engine, served_checkpoint, threaded_server

MODEL, KEY, ENGINE = SERVED_MODEL, SERVED_KEY, SERVED_ENGINE
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The quick brown fox", "Hello, world! How are", "Prefix caching lets requests", "It was the best of"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory, "core")


@pytest.fixture(scope="module")
def offline(checkpoint):
    with offline_engine(checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def core(checkpoint):
    """A core for the tests that drive the client directly (one event loop after another)."""
    with torch_threads(1):
        client = EngineCoreClient(str(checkpoint), **ENGINE)
    yield client
    client.close()
    assert client.process.exitcode == 0


@pytest.fixture(scope="module")
def server(checkpoint):
    with torch_threads(1):
        client = EngineCoreClient(str(checkpoint), **ENGINE)
    with threaded_server(checkpoint, ServerConfig(api_key=KEY), engine=client) as running:
        yield running
    client.process.join(30)
    assert client.process.exitcode == 0, "the lifespan's shutdown ends the core"


def greedy(offline, prompts, **fields):
    with torch_threads(1):
        return offline.generate(prompts, SamplingParams(temperature=0, **fields), use_tqdm=False)


def wait_until_idle(client: EngineCoreClient, timeout: float = 20.0) -> None:
    """Until the core reports no request and every block free (or fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = client.state()
        if s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_blocks:
            return
        time.sleep(0.02)
    pytest.fail(f"the core is not idle after {timeout} s: {client.state()}")


def fields_and_floats(output) -> tuple[dict, list[float]]:
    """Every field of an output but the request id, with its floats (log-probabilities) set
    apart: which requests share a step changes the matmuls' shapes, and with them the last
    bits of a logit, so floats are compared to 1e-5 and everything else exactly."""
    floats = []

    def split(value):
        if isinstance(value, float):
            floats.append(value)
            return float
        if isinstance(value, dict):
            return {k: split(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [split(v) for v in value]
        return value

    fields = dataclasses.asdict(output)
    del fields["request_id"], fields["metrics"]  # (times: each engine its own)
    return split(fields), floats


def same_output(got, want) -> bool:
    (g_fields, g_floats), (w_fields, w_floats) = fields_and_floats(got), fields_and_floats(want)
    return g_fields == w_fields and g_floats == pytest.approx(w_floats, abs=1e-5)


def assert_same_outputs(got: list, want: list, what: str) -> None:
    """Every output ``got`` is one of ``want``'s, in order, and the last is the last. (A
    caller behind its request's outputs gets the newest only: they are cumulative, so one
    it skipped is in the next. Which ones a caller skips depends on timing.)"""
    assert got, f"{what}: no output"
    j = 0
    for k, g in enumerate(got):
        while j < len(want) and not same_output(g, want[j]):
            j += 1
        assert j < len(want), f"{what}: output {k} of {len(got)} is none of the in-thread engine's {len(want)}, in order"
        j += 1
    assert same_output(got[-1], want[-1]), f"{what}: the last output differs"


def workload(tokenizer, stop: str) -> list[tuple[list[int], str | None, SamplingParams]]:
    """Requests that between them use every kind of output the engine makes."""
    text = "It was the best of times"
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [
        ([5, 17, 301, 42], None, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        (ids, text, SamplingParams(temperature=0, max_tokens=24, logprobs=3)),
        ([7, 8, 9], None, SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)),
        ([10, 11], None, SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=12, logprobs=2, ignore_eos=True)),
        (ids, text, SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True)),
        (ids, text, SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True,
                                   ignore_eos=True)),
        ([20, 21, 22], None, SamplingParams(temperature=0, max_tokens=15, min_tokens=15, stop_token_ids=[63, 74])),
        ([30, 31], None, SamplingParams(temperature=0.7, seed=5, max_tokens=14, presence_penalty=0.5,
                                        repetition_penalty=1.2, ignore_eos=True)),
    ]


async def every_output(engine, requests) -> list[list]:
    async def one(ids, text, params):
        return [o async for o in engine.generate(ids, params, prompt=text)]

    return await asyncio.gather(*(one(*r) for r in requests))


# -- the same outputs as the engine in a thread ------------------------------------------


def test_every_streamed_output_equals_the_in_thread_engines(core, offline):
    tokenizer = offline.get_tokenizer()
    [full] = greedy(offline, ["It was the best of times"], max_tokens=40, ignore_eos=True)
    stop = full.outputs[0].text[5:8]
    assert len(stop) == 3, f"the greedy text is too short to take a stop string from: {full.outputs[0].text!r}"
    requests = workload(tokenizer, stop)
    threaded = AsyncLLMEngine(offline.engine)

    async def in_thread():
        try:
            return await every_output(threaded, requests)
        finally:
            await threaded.shutdown()

    with torch_threads(1):
        want = asyncio.run(in_thread())
    got = asyncio.run(every_output(core, requests))
    for i, (w, g) in enumerate(zip(want, got)):
        assert_same_outputs(g, w, f"request {i} ({requests[i][2]})")
    finals = [g[-1] for g in got]
    assert finals[4].outputs[0].finish_reason == "stop" and finals[4].outputs[0].stop_reason == stop
    assert finals[5].outputs[0].text.endswith(stop)
    assert len(finals[3].outputs) == 3 and all(len(c.logprobs) == 12 for c in finals[3].outputs)
    # The held-back text came out in pieces that only ever grew.
    texts = [o.outputs[0].text for o in got[4]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    wait_until_idle(core)


def test_one_message_per_step_and_bytes_that_grow_with_the_tokens(core):
    """Eight requests of 24 tokens: the core's messages are one per step, not one per
    request per step. And a stream's traffic is linear in its length: what is sent for a
    request of 200 tokens is about twice what is sent for 100, not four times."""
    received = []
    feed = core._decoder.feed

    def counting(data):
        messages = feed(data)
        received.append((len(data), sum(m[0] == "outputs" for m in messages)))
        return messages

    core._decoder.feed = counting
    try:
        async def run(n, max_tokens):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            return await every_output(core, [([3 + i, 4, 5], None, params) for i in range(n)])

        received.clear()
        outputs = asyncio.run(run(8, 24))
        num_tokens = 8 * 24
        num_messages = sum(m for _, m in received)
        assert [len(o[-1].outputs[0].token_ids) for o in outputs] == [24] * 8
        assert num_messages < num_tokens / 4, (num_messages, num_tokens)

        sizes = {}
        for max_tokens in (100, 200):
            received.clear()
            asyncio.run(run(1, max_tokens))
            sizes[max_tokens] = sum(n for n, _ in received)
        assert sizes[200] < 2.5 * sizes[100], sizes
    finally:
        core._decoder.feed = feed
    wait_until_idle(core)


def test_what_the_socket_cannot_take_waits_and_goes_in_order(core, offline):
    """With the core stopped (SIGSTOP), adds fill the socket and the rest waits in the
    client, without blocking the event loop; once the core runs again, every request is
    served, and served right."""
    prompts = [[3 + i % 500] * 450 for i in range(300)]  # about 300 KiB of adds: more than the socket holds
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def run():
        os.kill(core.process.pid, signal.SIGSTOP)
        try:
            tasks = [asyncio.ensure_future(every_output(core, [(p, None, params)])) for p in prompts]
            start = time.perf_counter()
            while not core._unsent:
                await asyncio.sleep(0.01)
                assert time.perf_counter() - start < 10, "the socket took every add: nothing waited"
            await asyncio.sleep(0.2)
            assert core._unsent and not any(t.done() for t in tasks)
        finally:
            os.kill(core.process.pid, signal.SIGCONT)
        return await asyncio.gather(*tasks)

    got = asyncio.run(run())
    assert not core._unsent
    want = greedy(offline, prompts[:20], max_tokens=2, ignore_eos=True)
    assert [g[0][-1].outputs[0].token_ids for g in got[:20]] == [w.outputs[0].token_ids for w in want]
    assert all(g[0][-1].finished for g in got)
    wait_until_idle(core)


def test_a_bad_request_is_refused_here_with_the_engines_own_checks(core):
    with pytest.raises(ValueError, match="prompt"):
        core.validate([5, 10**6])
    with pytest.raises(ValueError, match="n="):
        core.validate([5, 6], SamplingParams(n=ENGINE["max_num_seqs"] + 1))
    assert core.max_model_len == 512 and core.vocab_size == 512


# -- over HTTP ---------------------------------------------------------------------------


def test_the_openai_client_gets_the_offline_outputs(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    expected = greedy(offline, PROMPTS, max_tokens=16, logprobs=2)
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
        assert got.choices[0].text == want.outputs[0].text
        chosen = [entry[t].logprob for t, entry in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(chosen, abs=1e-5)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
    messages = [{"role": "user", "content": "Hello, world!"}]
    with torch_threads(1):
        [want] = offline.chat(messages, SamplingParams(temperature=0.9, seed=4, max_tokens=12, n=2), use_tqdm=False)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.9, seed=4, n=2)
    assert [c.message.content for c in got.choices] == [c.text for c in want.outputs]


def test_structured_output_through_the_core(server, offline):
    """The server compiles a request's grammar to check it (a bad one is its 400, the core
    never sees it); the core compiles its own while it steps the others: the outputs are the
    offline engine's, and follow the schema."""
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["word", "n"]}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    spec = StructuredOutputsParams(json=schema)
    want = greedy(offline, PROMPTS[:2], max_tokens=60, structured_outputs=spec)
    for prompt, expected in zip(PROMPTS, want):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0,
                                        extra_body={"structured_outputs": {"json": schema}})
        assert got.choices[0].text == expected.outputs[0].text and got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].text), schema)
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={
        "prompt": "x", "structured_outputs": {"json": {"type": "object", "not": {}}}})
    assert r.status_code == 400 and "unsupported JSON schema feature" in r.json()["error"]["message"]
    wait_until_idle(server.engine)


def test_clients_that_hang_up_free_their_blocks_in_the_core(server):
    client = server.engine
    aborted_before = client.num_aborted
    body = {"model": MODEL, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    in_use = []

    async def hang_up_after(http, i, chunks):
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": PROMPTS[i % 4] + f" {i}"}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen == chunks:
                    s = client.state()
                    in_use.append(s.num_blocks - s.num_free_blocks)
                    return  # leaving the block closes the connection mid-stream

    async def ten():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            await asyncio.gather(*(hang_up_after(http, i, 3 + i % 4) for i in range(10)))

    asyncio.run(ten())
    assert max(in_use) > 0, "the streams held no blocks: nothing was tested"
    wait_until_idle(client)
    assert client.num_aborted - aborted_before == 10, "each client that left must abort its own request"

    # A non-streaming client that gives up (its read times out) is noticed too. The core is
    # stopped meanwhile (SIGSTOP), so however fast this CPU is, the request cannot finish
    # before its client is gone; the add and the abort wait in the socket, in order.
    os.kill(client.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "prompt": PROMPTS[0]},
                       headers=AUTH, timeout=0.3)
        deadline = time.monotonic() + 20
        while client._queues and time.monotonic() < deadline:  # until the server has seen it leave
            time.sleep(0.02)
        assert not client._queues
    finally:
        os.kill(client.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while client.num_aborted - aborted_before < 11 and time.monotonic() < deadline:
        time.sleep(0.02)
    wait_until_idle(client)
    assert client.num_aborted - aborted_before == 11


def test_a_request_the_engine_fails_fails_alone(server, monkeypatch):
    """Values that pass every check but break the sampler (planted past the checks) fail
    their own request in the core; the requests beside it are served, the core lives."""
    real = api.to_sampling_params

    def planted(body):
        params = real(body)
        if body.user == "saboteur":
            params.top_p = "not a number"
        return params

    monkeypatch.setattr(api, "to_sampling_params", planted)
    good = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0.7, "top_p": 0.9, "seed": 3,
            "ignore_eos": True}
    bad_body = {**good, "max_tokens": 12, "user": "saboteur"}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            # The good request runs first, so every step the saboteurs are in holds its row
            # too (a step whose every row fails is the engine's failure, not a request's).
            async with http.stream("POST", "/v1/completions", json={**good, "stream": True}) as r:
                chunks = r.aiter_text()
                first = await anext(chunks)

                async def streamed(b):
                    async with http.stream("POST", "/v1/completions", json={**b, "stream": True}) as s:
                        return await s.aread()

                bad, bad_stream = await asyncio.gather(http.post("/v1/completions", json=bad_body),
                                                       streamed(bad_body))
                rest = "".join([first] + [c async for c in chunks])
        return rest, bad, bad_stream

    ok_stream, bad, bad_stream = asyncio.run(run())
    events = [e[len("data: "):] for e in ok_stream.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert sum(len(json.loads(e)["choices"]) for e in events[:-1] if json.loads(e)["choices"]) > 0
    assert not any("error" in json.loads(e) for e in events[:-1])
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    *_, error_event, done = [e[len("data: "):] for e in bad_stream.decode().split("\n\n") if e]
    assert done == "[DONE]" and "error" in json.loads(error_event)
    assert server.engine.error is None and httpx.get(server.url + "/health").status_code == 200
    wait_until_idle(server.engine)


def test_metrics_read_the_cores_load(server):
    def gauges() -> dict:
        page = httpx.get(server.url + "/metrics").text
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc"))}

    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        during = gauges()
    assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0, during
    wait_until_idle(server.engine)
    after = gauges()
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0, after


# -- when the core dies --------------------------------------------------------------------


def sse_payloads(raw: str) -> list[str]:
    return [e[len("data: "):] for e in raw.split("\n\n") if e]


def test_a_killed_core_ends_every_stream_with_an_error_and_health_says_503(checkpoint):
    with torch_threads(1):
        client = EngineCoreClient(str(checkpoint), **ENGINE)
    died = []
    client.on_dead = lambda: died.append(True)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with ServerThread(build_app(client, MODEL)) as running:
        async def streams():
            async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:
                async def one(i):
                    async with http.stream("POST", "/v1/completions", json={**body, "prompt": PROMPTS[i]}) as r:
                        raw, killed = "", False
                        async for chunk in r.aiter_text():
                            raw += chunk
                            if i == 0 and not killed and raw.count("data: {") >= 5:
                                os.kill(client.process.pid, signal.SIGKILL)  # a crash, an OOM kill
                                killed = True
                        return raw

                return await asyncio.gather(*(one(i) for i in range(3)))

        for raw in asyncio.run(streams()):
            *_, error_event, done = sse_payloads(raw)
            assert done == "[DONE]"
            error = json.loads(error_event)["error"]
            assert error["type"] == "server_error" and "see the server log" in error["message"]
        assert httpx.get(running.url + "/health").status_code == 503
        assert died == [True] and isinstance(client.error, RuntimeError)
        refused = httpx.post(running.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert refused.status_code == 503
    assert client.process.exitcode == -signal.SIGKILL


def test_a_request_after_shutdown_is_refused(checkpoint):
    with torch_threads(1):
        client = EngineCoreClient(str(checkpoint), **ENGINE)

    async def run():
        client.start()
        await client.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in client.generate([5, 6], SamplingParams(max_tokens=2)):
                pass

    asyncio.run(run())
    assert client.process.exitcode == 0


PLANTED_FAULT = """\
import minivllm.engine.llm_engine as m
real = m.LLMEngine.step
calls = [0]
def step(self):
    if self.has_unfinished_requests():
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError('planted device fault 0xdead')
    return real(self)
m.LLMEngine.step = step
"""


def core_pid(server: ServeProcess) -> int:
    pid = server.engine_core_pid()
    assert pid is not None, "no engine core process under minivllm serve"
    return pid


def gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_serve_a_step_that_raises_in_the_core_is_loud_and_the_server_exits_1(tmp_path):
    """The fault is planted in the core's own interpreter (a sitecustomize module, which
    every Python process on that path imports at start), in its third step."""
    (tmp_path / "sitecustomize.py").write_text(PLANTED_FAULT)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with ServeProcess(["--engine-process"], env=env) as server:
        pid = core_pid(server)
        body = {"model": "bundled", "prompt": "It was", "max_tokens": 50, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            raw = r.read().decode()
        *_, error_event, done = sse_payloads(raw)
        assert done == "[DONE]"
        error = json.loads(error_event)["error"]
        assert error["type"] == "server_error" and "0xdead" not in error["message"]
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and "0xdead" not in health.text
        assert server.proc.wait(timeout=30) == 1
        log = server.log()
        assert "Traceback" in log and "planted device fault 0xdead" in log
        assert gone(pid)


def test_serve_a_killed_core_makes_the_server_exit_1():
    with ServeProcess(["--engine-process"], env={"OMP_NUM_THREADS": "1"}) as server:
        os.kill(core_pid(server), signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        assert "the engine core died" in server.log()


def test_serve_the_core_ends_with_the_server_however_the_server_ends():
    """Stopped (SIGTERM, as a supervisor stops it): the server shuts down, and the core with
    it, asked to. Killed (SIGKILL: no cleanup runs): the core sees its socket close and exits."""
    with ServeProcess(["--engine-process"], env={"OMP_NUM_THREADS": "1"}) as server:
        pid = core_pid(server)
        body = {"model": "bundled", "prompt": "It was", "max_tokens": 4}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        server.proc.terminate()
        # uvicorn shuts down gracefully, then raises the signal again so that the exit
        # status still says what ended the process.
        assert server.proc.wait(timeout=60) == -signal.SIGTERM
        assert gone(pid, timeout=5)
        log = server.log()
        assert "Application shutdown complete" in log and "did not exit" not in log, log
    with ServeProcess(["--engine-process"], env={"OMP_NUM_THREADS": "1"}) as server:
        pid = core_pid(server)
        server.proc.kill()
        server.proc.wait()
        assert gone(pid), "the core outlived the server"


def test_serve_a_bad_flag_is_a_usage_error_with_the_core_in_a_process():
    from minivllm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--engine-process", "--max-num-seqs", "0"])
    assert exit_.value.code == 2


def test_the_default_is_a_process_on_a_gpu_and_a_thread_on_a_cpu():
    from minivllm.cli import build_parser, parse_args, uses_engine_process

    parser = build_parser()
    assert uses_engine_process(parse_args(parser, ["serve", "--device", "cuda"]))
    assert not uses_engine_process(parse_args(parser, ["serve", "--device", "cpu"]))
    assert uses_engine_process(parse_args(parser, ["serve", "--device", "cpu", "--engine-process"]))
    assert not uses_engine_process(parse_args(parser, ["serve", "--device", "cuda", "--no-engine-process"]))


@pytest.mark.gpu
def test_gpu_the_core_in_a_process_gives_the_offline_greedy_tokens(checkpoint):
    """On CUDA (async scheduling and CUDA graphs on), in float32, whose true float32 dot
    products make greedy tokens independent of which requests share a step: the tokens
    served through the core's process are the offline engine's."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(4, 40))] for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(checkpoint), device="cuda", dtype="float32", **ENGINE)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    client = EngineCoreClient(str(checkpoint), device="cuda", dtype="float32", **ENGINE)
    try:
        assert client.config.async_scheduling and client.config.device.startswith("cuda")
        got = asyncio.run(every_output(client, [(p, None, params) for p in prompts]))
    finally:
        client.close()
    assert [g[-1].outputs[0].token_ids for g in got] == want
