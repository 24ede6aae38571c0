"""The OpenAI-compatible server, end to end over loopback HTTP.

One server (uvicorn on a background thread, a free loopback port, a tiny random model with
a tokenizer) serves every test here. The official ``openai`` client must get exactly what
the offline ``LLM`` gives greedily; 200 concurrent requests must all come back right; 20
streaming clients that hang up mid-stream must leave the KV pool entirely free; every bad
request gets its 4xx and OpenAI's error shape, and the next good request still works.
"""
import asyncio
import io
import json
import random
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from minivllm import SamplingParams
from minivllm.server import AsyncLLMEngine
from minivllm.testing import torch_threads
from shared import SERVED_ENGINE, SERVED_KEY, SERVED_MODEL, offline_engine, served_checkpoint, threaded_server

MODEL, KEY, ENGINE = SERVED_MODEL, SERVED_KEY, SERVED_ENGINE
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The quick brown fox", "Hello, world! How are", "Prefix caching lets requests", "It was the best of"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return served_checkpoint(tmp_path_factory, "served")


@pytest.fixture(scope="module")
def offline(checkpoint):
    with offline_engine(checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(checkpoint):
    with threaded_server(checkpoint) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy(offline, prompts, **fields):
    with torch_threads(1):
        return offline.generate(prompts, SamplingParams(temperature=0, **fields), use_tqdm=False)


def wait_until_idle(engine: AsyncLLMEngine, timeout: float = 20.0) -> None:
    """Until the engine has no request and every block is free again (or fail)."""
    bm = engine.engine.block_manager
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks:
            return
        time.sleep(0.02)
    pytest.fail(f"engine not idle after {timeout} s: {bm.num_free_blocks}/{bm.num_blocks} blocks free, "
                f"unfinished={engine.engine.has_unfinished_requests()}")


# -- the official client gets the offline engine's greedy outputs ----------------------


def test_completions_equal_offline(client, offline):
    expected = greedy(offline, PROMPTS, max_tokens=16)
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        choice = got.choices[0]
        assert choice.text == want.outputs[0].text
        assert choice.finish_reason == want.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert got.model == MODEL and got.object == "text_completion"
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.outputs[0].finish_reason
        assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    assert any(w.outputs[0].text for w in expected), "every greedy text is empty: the comparison says little"


def test_completions_from_token_ids_with_logprobs(client, offline):
    ids = [5, 17, 301, 42, 7, 99, 250]
    [want] = greedy(offline, [ids], max_tokens=10, logprobs=3)
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == want.outputs[0].text
    expected = [entry[t].logprob for t, entry in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_equal_offline(client, offline):
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"},
                    {"role": "assistant", "content": "The quick brown fox"}, {"role": "user", "content": "How are you?"}]
    with torch_threads(1):
        [want] = offline.chat(conversation, SamplingParams(temperature=0, max_tokens=20, logprobs=2), use_tqdm=False)
    got = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=20, temperature=0,
                                         logprobs=True, top_logprobs=2)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    chosen = [entry[t].logprob for t, entry in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert [c.logprob for c in got.choices[0].logprobs.content] == pytest.approx(chosen, abs=1e-5)
    assert all(len(c.top_logprobs) == 2 for c in got.choices[0].logprobs.content)

    chunks = list(client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_sampling_fields_reach_the_engine(client, offline):
    prompt = PROMPTS[1]
    # A seed: the same sampled text as offline with that seed, and a different one without.
    with torch_threads(1):
        [seeded] = offline.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16,
                                                             ignore_eos=True), use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=11,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == seeded.outputs[0].text
    # A stop string taken from the greedy text itself: cut there, finish_reason "stop".
    [full] = greedy(offline, [prompt], max_tokens=24, ignore_eos=True)
    text = full.outputs[0].text
    assert len(text) > 6, f"greedy text too short to pick a stop string from: {text!r}"
    stop = text[3:6]
    [want] = greedy(offline, [prompt], max_tokens=24, ignore_eos=True, stop=[stop])
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == want.outputs[0].text
    assert stop not in got.choices[0].text
    # max_tokens and the vLLM extension min_tokens + ignore_eos: exactly that many tokens.
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True, "min_tokens": 5})
    assert got.usage.completion_tokens == 5 and got.choices[0].finish_reason == "length"


def test_sse_framing_and_models(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", "a stream ends with 'data: [DONE]' and a blank line"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event[len("data: "):])["object"] == "text_completion"
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


# -- many clients ----------------------------------------------------------------------


def test_200_concurrent_requests(server, offline):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(4, 40))] for _ in range(200)]
    expected = [o.outputs[0].token_ids for o in greedy(offline, prompts, max_tokens=8, ignore_eos=True)]

    async def one(client, i):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        if i % 2:  # half of them stream
            body |= {"stream": True}
            tokens = []
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        tokens += json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
            return tokens
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["logprobs"]["tokens"]

    async def all_of_them():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(200))), timeout=120)

    got = asyncio.run(all_of_them())
    tokenizer = offline.get_tokenizer()
    for i, (tokens, want) in enumerate(zip(got, expected)):
        assert tokens == [tokenizer.decode([t]) for t in want], f"request {i}: {tokens} != offline {want}"
    wait_until_idle(server.engine)


def test_clients_that_disconnect_free_the_pool(server):
    engine = server.engine
    aborted_before = engine.num_aborted
    body = {"model": MODEL, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}

    async def hang_up_after(client, i, chunks):
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": PROMPTS[i % 4] + f" {i}"}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen == chunks:
                    return  # leaving the block closes the connection mid-stream

    async def twenty():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            await asyncio.gather(*(hang_up_after(client, i, 2 + i % 3) for i in range(20)))

    asyncio.run(twenty())
    wait_until_idle(engine)
    assert engine.num_aborted - aborted_before == 20, "each client that left must abort its own request"

    # A non-streaming client that gives up (its read times out) is noticed too. The engine
    # thread is held up meanwhile, so however fast this CPU is, the request cannot finish
    # before its client is gone.
    gate = threading.Event()
    engine._executor.submit(gate.wait, 30)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "prompt": PROMPTS[0]},
                       headers=AUTH, timeout=0.3)
        deadline = time.monotonic() + 20
        while engine._queues and time.monotonic() < deadline:  # until the server has seen it leave
            time.sleep(0.02)
    finally:
        gate.set()
    engine._executor.submit(lambda: None).result(timeout=30)  # jobs run in order: the add and abort are done
    wait_until_idle(engine)
    assert engine.num_aborted - aborted_before == 21


# -- bad input -------------------------------------------------------------------------

TOO_LONG = "fox " * 600  # more tokens than the 512-token context

BAD = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny-qwen3", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("model not a string", "/v1/chat/completions", {"model": 7, "messages": [{"role": "user", "content": "hi"}]},
     400, "model"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": TOO_LONG}, 400, "prompt"),
    ("chat too long", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": TOO_LONG}]},
     400, "messages"),
    ("prompt + max_tokens too long", "/v1/completions", {"model": MODEL, "prompt": [5] * 500, "max_tokens": 100}, 400,
     "max_tokens"),
    ("token id out of range", "/v1/completions", {"model": MODEL, "prompt": [5, 99999]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400,
     "temperature"),
    ("top_p zero", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ("max_tokens zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("too many logprobs", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("max_tokens a string", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400,
     "max_tokens"),
    ("temperature a string", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400,
     "temperature"),
    ("prompt an object", "/v1/completions", {"model": MODEL, "prompt": {"text": "hi"}}, 400, "prompt"),
    ("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
     400, "messages"),
    ("stream not a bool", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    # A field this server knows of and cannot honour (unlike one it has never heard of: see
    # test_unknown_fields_are_ignored_with_a_warning).
    ("known, not supported", "/v1/completions", {"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400,
     "use_beam_search"),
    ("prompt_logprobs streamed", "/v1/completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 2,
                                                     "stream": True}, 400, "prompt_logprobs"),
    ("prompt_logprobs too many", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("max_tokens zero without echo", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0,
                                                         "echo": False}, 400, "max_tokens"),
    ("a tool that is no function", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools"),
    ("stream_options without stream", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("an image part", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ("a user's content null", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]},
     400, "messages"),
    ("too many prompts", "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 257}, 400, "prompt"),
    ("a bad prompt in a batch", "/v1/completions", {"model": MODEL, "prompt": [[5, 6], [5, 99999]]}, 400, "prompt"),
    ("a mixed batch", "/v1/completions", {"model": MODEL, "prompt": ["hi", [5, 6]]}, 400, "prompt"),
    ("continue and open", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("a client's chat template", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"}, 400,
     "chat_template"),
    ("a reserved template kwarg", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
     400, "chat_template_kwargs"),
    ("n zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("n past max_num_seqs", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 65}, 400, "n"),
    ("penalty out of range", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3.0}, 400,
     "presence_penalty"),
    ("logit_bias key not a token id", "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}},
     400, "logit_bias"),
    ("logit_bias id past the vocabulary", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("no such route", "/v1/embeddings", {"model": MODEL, "input": "hi"}, 404, None),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_4xx_and_the_server_goes_on(server, client, offline, case):
    name, path, body, status, param = case
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(server.url + path, headers={**AUTH, "Content-Type": "application/json"}, timeout=30,
                          **kwargs)
    assert response.status_code == status, f"{name}: {response.status_code} {response.text}"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert error["param"] == param, f"{name}: param {error['param']!r}, message {error['message']!r}"
    # The next good request is served, and served right.
    [want] = greedy(offline, [PROMPTS[2]], max_tokens=6)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0)
    assert got.choices[0].text == want.outputs[0].text
    assert server.engine.error is None


def test_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])


def test_wrong_method(server):
    response = httpx.get(server.url + "/v1/completions", headers=AUTH)
    assert response.status_code == 405 and "error" in response.json()


def test_api_key(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        response = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.post(server.url + "/v1/completions", json=body, headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


# -- the CLI's chat --------------------------------------------------------------------


def test_cli_chat_is_multi_turn(checkpoint, offline):
    from minivllm.cli import run_chat

    turns = iter(["Hello, world!", "How are you?", "/exit"])
    out = io.StringIO()
    args = SimpleNamespace(model=str(checkpoint), system=None, max_tokens=8, temperature=0.0, seed=None)
    with torch_threads(1):
        run_chat(args, input=lambda prompt: next(turns), output=out)
        history = [{"role": "user", "content": "Hello, world!"}]
        [first] = offline.chat(history, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        history += [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "How are you?"}]
        [second] = offline.chat(history, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    lines = out.getvalue().splitlines()
    assert lines[1:3] == [first.outputs[0].text, second.outputs[0].text]


def test_a_lagging_reader_gets_each_requests_newest_output_only():
    """``merged`` hands on only the newest of a request's outputs that queued up while its
    reader was busy (they are cumulative: the newest holds the others' tokens), and every
    output when the reader keeps up."""
    from contextlib import aclosing

    from minivllm.server.streaming import merged

    async def outputs(name: str, n: int, paced: asyncio.Event | None = None):
        for k in range(n):
            if paced is not None:
                await paced.wait()
                paced.clear()
            yield f"{name}{k}"  # stands for a cumulative RequestOutput

    async def lagging():
        async with aclosing(merged([outputs("a", 5), outputs("b", 3)])) as events:
            return [x async for x in events]  # both streams queue everything before the first read

    async def keeping_up():
        go = asyncio.Event()
        got = []
        async with aclosing(merged([outputs("a", 4, go)])) as events:
            go.set()
            async for x in events:
                got.append(x)
                go.set()
        return got

    assert asyncio.run(lagging()) == [(0, "a4"), (1, "b2")]
    assert asyncio.run(keeping_up()) == [(0, "a0"), (0, "a1"), (0, "a2"), (0, "a3")]
