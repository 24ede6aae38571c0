"""What a grammar's compile may cost (chapter 18): it never runs on the server's event loop,
and never holds up the engine's other requests; two requests with one spec share one
compile; the cache of compiled grammars is bounded, in grammars and in bytes; a spec over
the size or nesting limit is refused naming the limit.

A compile is made slow here by holding it on an event, so that "the others went on while it
ran" is checked by construction rather than by timing.
"""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.sampling_params import InvalidParameter
from minivllm.server import AsyncLLMEngine
from minivllm.server.api import ServerThread, build_app
from minivllm.structured.compiler import MAX_SCHEMA_DEPTH, GrammarCompiler
from minivllm.structured.params import MAX_SPEC_CHARS

pytestmark = pytest.mark.usefixtures("one_thread")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
MESSAGES = [{"role": "user", "content": "Who are you?"}]
HOLD_S = 20  # how long a held compile waits at most: far longer than any check below


class HeldCompiles:
    """Patch a compiler so that each compile waits until released: ``started`` is set when
    one begins, ``finished`` when one ends."""

    def __init__(self, compiler: GrammarCompiler):
        self.started, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()
        self.compiler, original = compiler, compiler._compile

        def held(params):
            self.started.set()
            assert self.release.wait(HOLD_S), "the held compile was never released"
            try:
                return original(params)
            finally:
                self.finished.set()

        compiler._compile = held

    def undo(self):
        del self.compiler._compile  # the class's method again


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=16, num_kv_blocks=256)  # (sized: on a GPU two engines at 90% would not fit)


@pytest.fixture(scope="module")
def server():
    # An engine of its own: while the server runs, its AsyncLLMEngine owns the engine.
    engine = AsyncLLMEngine(LLM(max_num_seqs=16, num_kv_blocks=256).engine)
    with ServerThread(build_app(engine, "bundled")) as running:
        running.engine = engine
        yield running


def test_a_slow_compile_does_not_hold_up_the_server(server):
    held = HeldCompiles(server.engine.grammar_compiler())
    schema = {**PERSON, "title": "held"}  # a spec no other test compiled
    try:
        with ThreadPoolExecutor(1) as pool:
            constrained = pool.submit(httpx.post, server.url + "/v1/chat/completions", timeout=HOLD_S + 30, json={
                "messages": MESSAGES, "max_tokens": 60, "seed": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
            assert held.started.wait(30)
            # The compile is under way and cannot end: the server answers everyone else.
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            plain = httpx.post(server.url + "/v1/completions", timeout=30,
                               json={"prompt": "Once upon a time", "max_tokens": 5})
            assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length"
            assert not held.finished.is_set() and not constrained.done()
            held.release.set()
            r = constrained.result()
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    finally:
        held.release.set()
        held.undo()


def test_a_bad_schema_is_still_a_400_naming_it(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert 'Unsupported type "strin"' in r.json()["error"]["message"]


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "description": "x" * MAX_SPEC_CHARS}}}},
     f"json must be at most {MAX_SPEC_CHARS} characters"),
    ({"structured_outputs": {"regex": "a" * (MAX_SPEC_CHARS + 1)}}, f"regex must be at most {MAX_SPEC_CHARS} characters"),
    ({"structured_outputs": {"json": '{"items": ' * (MAX_SCHEMA_DEPTH + 1) + "{}" + "}" * (MAX_SCHEMA_DEPTH + 1)}},
     f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels"),
])
def test_a_spec_over_a_limit_is_a_400_naming_the_limit(server, body, message):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


# -- the engine: the others step on while a grammar compiles ------------------------------------


@pytest.fixture(scope="module")
def async_llm():
    return LLM(max_num_seqs=16, num_kv_blocks=256, async_scheduling=True)


@pytest.mark.parametrize("which", ["llm", "async_llm"])
def test_the_engine_steps_the_others_while_a_grammar_compiles(request, which):
    """What the engine core in its own process does with a grammar it has not compiled (the
    server compiled it in its own process): the request waits, the batch does not; with the
    synchronous loop and the asynchronous one (whose step in flight the admission waits for)."""
    llm = request.getfixturevalue(which)
    engine = llm.engine
    held = HeldCompiles(engine.grammar_compiler())
    try:
        plain = engine.add_request(llm.get_tokenizer().encode("Once upon a time"), SamplingParams(max_tokens=8))
        schema = {**PERSON, "title": f"held in the engine ({which})"}
        constrained = engine.add_request(llm.get_tokenizer().encode("Data:"), SamplingParams(
            temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema)))
        assert held.started.wait(30) and engine.num_compiling == 1
        finished = {}
        while plain not in finished:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        assert finished[plain].outputs[0].finish_reason == "length" and not held.finished.is_set()
        assert constrained not in finished and engine.has_unfinished_requests()
        held.release.set()
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        jsonschema.validate(json.loads(finished[constrained].outputs[0].text), schema)
    finally:
        held.release.set()
        held.undo()


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(llm):
    engine = llm.engine
    held = HeldCompiles(engine.grammar_compiler())
    try:
        rid = engine.add_request([5, 6, 7], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]{3}z")))
        assert held.started.wait(30)
        assert engine.abort_request(rid)
        assert not engine.has_unfinished_requests() and engine.num_compiling == 0
        held.release.set()
        assert held.finished.wait(30)
        assert engine.step() == []
    finally:
        held.release.set()
        held.undo()


def test_a_grammar_that_fails_to_compile_in_the_engine_fails_its_request_alone(llm):
    """add_request does not compile on the caller's thread: a bad spec nobody checked first
    ends its request with an error, and the others finish as they would."""
    engine = llm.engine
    plain = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    bad = engine.add_request([5, 6, 8], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab")))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs[plain].outputs[0].finish_reason == "length" and outputs[plain].error is None
    assert outputs[bad].outputs[0].finish_reason == "error"
    assert "invalid regular expression" in outputs[bad].error
    assert bad not in engine.requests


# -- the compiler --------------------------------------------------------------------------------


@pytest.fixture
def compiler(llm):
    engine = llm.engine
    return GrammarCompiler(llm.get_tokenizer(), engine.runner.model_config.vocab_size, sorted(engine.eos_token_ids))


def test_callers_of_one_spec_share_one_compile(compiler):
    held = HeldCompiles(compiler)
    spec = StructuredOutputsParams(json=PERSON)
    futures = [compiler.submit(spec) for _ in range(3)]
    with ThreadPoolExecutor(2) as pool:
        on_threads = [pool.submit(compiler.compile, spec) for _ in range(2)]
        assert held.started.wait(30)
        time.sleep(0.05)  # (the threads are waiting on the compile under way)
        held.release.set()
        grammars = [f.result(30) for f in futures + on_threads]
    assert all(g is grammars[0] for g in grammars)
    assert compiler.misses == 1 and len(compiler.compile_seconds) == 1
    assert compiler.submit(spec).result() is grammars[0] and compiler.hits >= 1


def test_a_failed_compile_reaches_every_caller_and_is_not_cached(compiler):
    spec = StructuredOutputsParams(regex="[a-")
    futures = [compiler.submit(spec) for _ in range(2)]
    for future in futures:
        with pytest.raises(InvalidParameter, match="invalid regular expression"):
            future.result(30)
    assert not compiler.cache and not compiler.compiling
    with pytest.raises(InvalidParameter):
        compiler.compile(spec)


def test_the_cache_is_bounded_in_grammars_and_in_bytes(compiler):
    specs = [StructuredOutputsParams(regex=f"[a-z]{{{i},{i + 4}}}") for i in range(1, 7)]
    compiler.cache_size = 3
    for spec in specs:
        compiler.compile(spec)
    assert list(compiler.cache) == [s.key for s in specs[-3:]]  # the least recently used went first
    compiler.compile(specs[3])  # a hit moves it to the back
    compiler.compile(specs[0])
    assert list(compiler.cache) == [s.key for s in (specs[5], specs[3], specs[0])]
    assert compiler.cached_bytes == sum(g.memory_size_bytes for g in compiler.cache.values())
    # In bytes: a budget of two grammars' worth keeps two.
    sizes = [g.memory_size_bytes for g in compiler.cache.values()]
    compiler.cache_size, compiler.cache_bytes = 100, sizes[-1] + sizes[-2]
    compiler.compile(specs[1])
    assert len(compiler.cache) <= 2 and compiler.cached_bytes <= max(compiler.cache_bytes,
                                                                     compiler.cache[specs[1].key].memory_size_bytes)
    assert compiler.cached_bytes == sum(g.memory_size_bytes for g in compiler.cache.values())
    compiler.cache_bytes = 1  # less than any grammar: the newest alone stays, for the request that asked
    compiler.compile(specs[2])
    assert list(compiler.cache) == [specs[2].key]


def test_a_schema_just_within_the_nesting_limit_compiles_quickly(compiler):
    """The limit keeps a compile short: compile time grows with the cube of the depth."""
    deepest = '{"type": "array", "items": ' * (MAX_SCHEMA_DEPTH - 1) + '{"type": "string"}' + "}" * (MAX_SCHEMA_DEPTH - 1)
    compiler.compile(StructuredOutputsParams(json='{"type": "string"}'))  # the compiler's one-time set-up, untimed
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=deepest))
    assert time.perf_counter() - start < 5  # (41 ms on a 2-core CI machine; 900 levels take 46 s)
    with pytest.raises(InvalidParameter, match=f"nests deeper than {MAX_SCHEMA_DEPTH} levels"):
        compiler.compile(StructuredOutputsParams(json='{"anyOf": [' * MAX_SCHEMA_DEPTH + "{}" + "]}" * MAX_SCHEMA_DEPTH))


def test_generate_without_the_servers_check_fails_a_bad_grammar_alone(llm):
    """AsyncLLMEngine.generate itself does not compile (the server calls compile_grammar
    first): the engine compiles what nobody checked, and fails that request alone."""
    import asyncio

    from minivllm.server.async_engine import RequestFailedError

    engine = AsyncLLMEngine(llm.engine)

    async def go():
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= ("))
        with pytest.raises(InvalidParameter, match="invalid EBNF grammar"):
            await engine.compile_grammar(bad)
        with pytest.raises(RequestFailedError, match="invalid EBNF grammar"):
            async for _ in engine.generate([5, 6, 7], SamplingParams(
                    structured_outputs=StructuredOutputsParams(grammar='root ::= "a" |'))):
                pass
        outputs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=3))]
        assert outputs[-1].outputs[0].finish_reason == "length"
        await engine.shutdown()

    asyncio.run(go())
    assert not llm.engine.has_unfinished_requests()
