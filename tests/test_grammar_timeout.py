"""A grammar's compile time is bounded (chapter 18): each spec is compiled on trial in a
worker process, killed past the compiler's time limit. A spec that takes longer fails its own
request, with an InvalidParameter naming the limit, for every caller that shares it; the
others' compiles go on; the worker is replaced and the next compile works; the cache keeps
nothing of it; and no worker outlives its compiler, its engine or its parent process.

The slow spec is real: an EBNF grammar of 3000 unbounded repetitions side by side takes
about 40 s to compile with the bundled 8k vocabulary, far past the small limits set here.
"""
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.sampling_params import InvalidParameter
from minivllm.server import AsyncLLMEngine
from minivllm.server.api import ServerThread, build_app
from minivllm.structured.compiler import COMPILE_TIMEOUT_S, GrammarCompiler

pytestmark = pytest.mark.usefixtures("one_thread")

SLOW_GRAMMAR = "root ::= " + " ".join(['[^"]*'] * 3000) + ' "x"'
SLOW = StructuredOutputsParams(grammar=SLOW_GRAMMAR)
LIMIT_S = 1.0  # the compilers' limit in these tests (a normal spec here compiles in about 20 ms)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
MESSAGE = f"did not compile within the limit of {LIMIT_S:g} s"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # (a zombie is gone too, but for its parent's wait)
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids, seconds: float = 10) -> bool:
    end = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_num_seqs=16, num_kv_blocks=256)
    yield llm
    llm.shutdown()


@pytest.fixture
def compiler(llm):
    engine = llm.engine
    compiler = GrammarCompiler(llm.get_tokenizer(), engine.runner.model_config.vocab_size,
                               sorted(engine.eos_token_ids), compile_timeout_s=LIMIT_S)
    yield compiler
    compiler.shutdown()


@pytest.fixture
def limited(llm):
    """The engine's compiler, with the small limit for one test."""
    compiler = llm.engine.grammar_compiler()
    compiler.compile_timeout_s = LIMIT_S
    yield compiler
    compiler.compile_timeout_s = COMPILE_TIMEOUT_S


def test_the_default_limit_leaves_real_specs_room():
    assert 5 <= COMPILE_TIMEOUT_S <= 60


def test_a_slow_compile_fails_every_caller_and_the_next_compile_works(compiler):
    compiler.compile(StructuredOutputsParams(json={"title": f"start the pool {time.monotonic_ns()}", **PERSON}))
    start = time.perf_counter()
    futures = [compiler.submit(SLOW), compiler.submit(SLOW)]  # one compile, shared
    with ThreadPoolExecutor(1) as pool:
        on_a_thread = pool.submit(compiler.compile, SLOW)
        errors = []
        for future in [*futures, on_a_thread]:
            with pytest.raises(InvalidParameter, match=MESSAGE) as caught:
                future.result(60)
            errors.append(caught.value)
    assert time.perf_counter() - start < 30  # (the compile itself takes about 40 s)
    assert all(e.param == "structured_outputs" and "structured_outputs.grammar" in str(e) for e in errors)
    assert compiler.workers.killed == 1  # the callers shared one trial
    assert SLOW.key not in compiler.cache and not compiler.compiling
    compiled = compiler.compile(StructuredOutputsParams(json=PERSON))
    assert compiled is compiler.cache[StructuredOutputsParams(json=PERSON).key]
    end = time.monotonic() + 30
    while len(compiler.workers.idle) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    assert len(compiler.workers.start_seconds) == 3 and len(compiler.workers.idle) == 2  # its worker was replaced
    # Asked again, it is tried again (nothing of the failure was kept) and fails again.
    with pytest.raises(InvalidParameter, match=MESSAGE):
        compiler.compile(SLOW)


def wait_for_two_idle_workers(compiler: GrammarCompiler) -> None:
    compiler.compile(StructuredOutputsParams(json={"title": f"start the pool {time.monotonic_ns()}", **PERSON}))
    end = time.monotonic() + 30
    while len(compiler.workers.idle) < 2 and time.monotonic() < end:  # (the second starts beside the first)
        time.sleep(0.01)
    assert len(compiler.workers.idle) == 2


def test_the_other_worker_compiles_while_one_is_held(compiler):
    compiler.compile_timeout_s = 3.0  # (room for the other compile on a busy machine)
    wait_for_two_idle_workers(compiler)
    held = compiler.submit(SLOW)
    end = time.monotonic() + 30
    while not compiler.workers.busy and time.monotonic() < end:
        time.sleep(0.01)
    assert compiler.workers.busy  # the slow compile is under way in a worker
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json={"title": "beside it", **PERSON}))
    assert not held.done(), f"the other compile waited for the slow one ({time.perf_counter() - start:.2f} s)"
    with pytest.raises(InvalidParameter, match="did not compile within the limit of 3 s"):
        held.result(60)


def test_a_bad_spec_is_refused_with_xgrammars_message_as_before(compiler):
    with pytest.raises(InvalidParameter, match="invalid regular expression: .*parenthesis is not closed"):
        compiler.compile(StructuredOutputsParams(regex="(ab"))
    assert compiler.workers.killed == 0  # refused by the worker, which lives on


def test_a_worker_that_dies_fails_its_compile_alone(compiler):
    compiler.compile_timeout_s = 60
    held = compiler.submit(SLOW)
    end = time.monotonic() + 30
    while not compiler.workers.busy and time.monotonic() < end:
        time.sleep(0.01)
    (worker,) = compiler.workers.busy
    worker.process.kill()
    with pytest.raises(InvalidParameter, match=r"the grammar compiler's process ended \(signal 9\)"):
        held.result(30)
    assert compiler.compile(StructuredOutputsParams(json=PERSON)) is not None


def test_no_limit_compiles_here_without_workers(llm):
    engine = llm.engine
    compiler = GrammarCompiler(llm.get_tokenizer(), engine.runner.model_config.vocab_size,
                               sorted(engine.eos_token_ids), compile_timeout_s=None)
    compiler.compile(StructuredOutputsParams(json=PERSON))
    with pytest.raises(InvalidParameter, match="invalid regular expression"):
        compiler.compile(StructuredOutputsParams(regex="(ab"))
    assert not compiler.workers.start_seconds and not compiler.workers.processes()


# -- no worker outlives what made it -------------------------------------------------------------


def test_shutdown_ends_the_workers(compiler):
    compiler.compile_timeout_s = 60  # (the slow compile is under way when the compiler shuts down)
    held = compiler.submit(SLOW)
    compiler.compile(StructuredOutputsParams(json=PERSON))
    end = time.monotonic() + 30
    while not (compiler.workers.busy and len(compiler.workers.processes()) == 2) and time.monotonic() < end:
        time.sleep(0.01)  # (the slow one's worker may still be starting)
    pids = [p.pid for p in compiler.workers.processes()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    compiler.shutdown()
    assert wait_gone(pids) and not compiler.workers.processes()
    with pytest.raises(RuntimeError, match="shut down"):  # the compile under way
        held.result(10)
    with pytest.raises(RuntimeError, match="shut down"):
        compiler.compile(StructuredOutputsParams(json={"title": "after", **PERSON}))


def test_llm_shutdown_ends_the_engines_workers():
    llm = LLM(max_num_seqs=4, num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{3}")), use_tqdm=False)
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    pids = [p.pid for p in llm.engine.grammar_compiler().workers.processes()]
    assert pids and all(alive(p) for p in pids)
    llm.shutdown()
    assert wait_gone(pids)


def test_a_worker_ends_when_its_parent_dies_mid_compile(tmp_path):
    """Killed, the parent runs no exit handler: the worker sees it gone and exits, though its
    compile has half a minute to go."""
    script = f"""
import sys, time
from transformers import AutoTokenizer
from minivllm.structured.compiler import GrammarCompiler
from minivllm.structured.params import StructuredOutputsParams
from minivllm.llm import BUNDLED_MODEL
tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
compiler = GrammarCompiler(tokenizer, len(tokenizer), [0], compile_timeout_s=120)
compiler.submit(StructuredOutputsParams(grammar={SLOW_GRAMMAR!r}))
while not compiler.workers.busy:
    time.sleep(0.01)
(worker,) = compiler.workers.busy
print(worker.process.pid, flush=True)
sys.stdin.read()
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pid = int(parent.stdout.readline())
        assert alive(pid)
        parent.kill()
        parent.wait()
        assert wait_gone([pid], 10)
    finally:
        parent.kill()
        parent.wait()


# -- the engine and the server: one slow spec fails alone -----------------------------------------


def test_the_engine_fails_a_slow_grammar_alone(llm, limited):
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    slow = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=SLOW)) for _ in range(2)]
    schema = {**PERSON, "title": "beside the slow one in the engine"}
    normal = engine.add_request(tokenizer.encode("Data:"), SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema)))
    plain = engine.add_request(tokenizer.encode("Once upon a time"), SamplingParams(max_tokens=8))
    order, outputs = [], {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
                outputs[o.request_id] = o
        assert time.perf_counter() - start < 60
    jsonschema.validate(json.loads(outputs[normal].outputs[0].text), schema)
    assert outputs[plain].outputs[0].finish_reason == "length"
    for rid in slow:
        assert outputs[rid].outputs[0].finish_reason == "error" and MESSAGE in outputs[rid].error
        assert rid not in engine.requests
    assert SLOW.key not in limited.cache
    # The next request with a grammar compiles and runs.
    after = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{3}")), use_tqdm=False)
    assert after[0].outputs[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine(LLM(max_num_seqs=16, num_kv_blocks=256).engine)
    with ServerThread(build_app(engine, "bundled")) as running:
        running.engine = engine
        yield running


def test_the_server_answers_others_while_a_slow_grammar_runs_out_its_time(server):
    compiler = server.engine.grammar_compiler()
    compiler.compile_timeout_s = limit = 5.0  # (time for the normal request to finish first)
    wait_for_two_idle_workers(compiler)
    body = {"messages": [{"role": "user", "content": "Who are you?"}], "max_tokens": 8,
            "structured_outputs": {"grammar": SLOW_GRAMMAR}}
    schema = {**PERSON, "title": "beside the slow one in the server"}
    # The slow grammars come from another client: a client's own grammars take turns
    # (server/grammar_gate.py), so its next request would wait for them.
    other_client = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    try:
        with ThreadPoolExecutor(2) as pool, other_client:
            slow = [pool.submit(other_client.post, server.url + "/v1/chat/completions", json=body, timeout=60)
                    for _ in range(2)]
            end = time.monotonic() + 30
            while not compiler.workers.busy and time.monotonic() < end:
                time.sleep(0.01)
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "Who are you?"}], "max_tokens": 60, "seed": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
            assert r.status_code == 200, r.text
            jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
            assert not any(f.done() for f in slow)  # the normal request did not wait for the slow ones
            for f in slow:
                refused = f.result()
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert f"did not compile within the limit of {limit:g} s" in error["message"]
                assert error["param"] == "structured_outputs"
        # The client's second request waited for its first (one compile per client at a time),
        # then ran the same spec to the limit in its own turn: two workers replaced.
        assert compiler.workers.killed == 2
        plain = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "structured_outputs": {"regex": "[a-z]{2}"}})
        assert plain.status_code == 200, plain.text
    finally:
        compiler.compile_timeout_s = COMPILE_TIMEOUT_S


def test_a_worker_that_cannot_start_is_an_error_naming_it():
    from minivllm.structured.compile_worker import WorkerPool

    pool = WorkerPool("not a tokenizer's JSON", 1)
    with pytest.raises(RuntimeError, match="a grammar compile worker failed to start"):
        pool.trial(("compile_regex", ("[a-z]",), {}), LIMIT_S)
    assert pool.starting == 0 and not pool.processes()
