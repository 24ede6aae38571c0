"""The offline API: LLM(...).generate / chat / stream, model resolution, bad input, aborts.

Shaped like vLLM's, so these tests read like its documentation: prompts as text, token ids
or dicts; outputs in prompt order with ``.outputs[0].text``; errors that name what was
wrong and leave every other request as it was.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.llm import BUNDLED_MODEL
from minivllm.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(tiny_qwen3_with_tokenizer):
    return LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=128, block_size=8)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    prompts = ["Hello, world!", [5, 6, 7, 8], {"prompt_token_ids": [9, 10, 11]}, {"prompt": "The quick brown fox"}]
    # Different lengths, so the requests finish in another order than they were given.
    lengths = [7, 2, 5, 3]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert [o.prompt for o in outputs] == ["Hello, world!", None, None, "The quick brown fox"]
    assert outputs[0].prompt_token_ids == tok.encode("Hello, world!", add_special_tokens=False)
    assert outputs[1].prompt_token_ids == [5, 6, 7, 8]
    assert outputs[2].prompt_token_ids == [9, 10, 11]
    assert outputs[3].prompt_token_ids == tok.encode("The quick brown fox", add_special_tokens=False)
    assert len({o.request_id for o in outputs}) == 4
    for o in outputs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and c.stop_reason is None
        assert c.logprobs is None
        assert c.text == tok.decode(c.token_ids).rstrip("\ufffd")

    # Text and its token ids are the same request; one SamplingParams serves every prompt.
    same = llm.generate(["Hello, world!", {"prompt_token_ids": outputs[0].prompt_token_ids}],
                        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert same[0].outputs[0].token_ids == same[1].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    # A single prompt (text, or one list of token ids) is a batch of one.
    [single] = llm.generate("Hello, world!", params[0], use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    [single] = llm.generate([5, 6, 7, 8], params[1], use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[1].outputs[0].token_ids
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_default_sampling_params_and_stop_reason(llm):
    [out] = llm.generate([[5, 6, 7, 8]], use_tqdm=False)  # vLLM's default: 16 tokens
    assert len(out.outputs[0].token_ids) == 16 or out.outputs[0].finish_reason == "stop"
    first = llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    [out] = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first[1]]),
                         use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == first[1]
    assert out.outputs[0].token_ids == first[: first.index(first[1]) + 1]
    [out] = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)
    assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    [out] = llm.chat(conversation, GREEDY, use_tqdm=False)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert out.prompt_token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # one special token
    [plain] = llm.generate([{"prompt_token_ids": out.prompt_token_ids}], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    # A list of conversations; without the generation prompt.
    outs = llm.chat([conversation, conversation[1:]], GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert len(outs) == 2 and not outs[1].prompt.endswith("assistant\n")
    assert outs[1].prompt == "<|im_start|>user\nHello, world!<|im_end|>\n"


def test_stream_deltas_add_up_to_the_generated_text(llm):
    prompt = "Hello, world!"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = llm.generate([prompt], params, use_tqdm=False)
    deltas = list(llm.stream(prompt, params))
    assert len(deltas) >= 3 and all(deltas)
    assert "".join(deltas) == expected.outputs[0].text
    assert not llm.engine.has_unfinished_requests()
    # Seeded sampling streams the same text as it generates.
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    assert "".join(llm.stream(prompt, params)) == llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    # Leaving a stream early aborts its request and frees its blocks.
    stream = llm.stream(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    assert llm.engine.has_unfinished_requests()
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_engine_arguments_are_checked(tiny_qwen3_with_tokenizer):
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(model=str(tiny_qwen3_with_tokenizer), max_num_seq=4)  # a typo of max_num_seqs
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=str(tiny_qwen3_with_tokenizer), block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=str(tiny_qwen3_with_tokenizer), dtype="float8")
    with pytest.raises(ValueError, match="no/such/folder/here"):
        LLM(model="no/such/folder/here")


def test_string_prompt_needs_a_tokenizer(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "no-tokenizer", seed=0)
    llm = LLM(model=str(path), num_kv_blocks=16)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    [out] = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 8


def populate_hub_cache(cache: Path, repo_id: str, files: Path) -> str:
    """Lay ``files`` out as huggingface_hub's cache does after a download.

    models--{org}--{name}/blobs/<id> hold the bytes, snapshots/<commit>/<file> link to
    them, and refs/main names the commit.
    """
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    for i, f in enumerate(sorted(files.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, repo / "snapshots" / commit), repo / "snapshots" / commit / f.name)
    (repo / "refs" / "main").write_text(commit)  # no newline, as the hub client writes it
    return commit


def test_hub_id_resolves_through_the_cache(tiny_qwen3_with_tokenizer, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    home = tmp_path / "hf"
    commit = populate_hub_cache(home / "hub", "tiny-org/tiny-qwen3", tiny_qwen3_with_tokenizer)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The hub client reads these once, at import: point its copies at the test cache too.
    monkeypatch.setattr(hub_constants, "HF_HOME", str(home), raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"), raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True, raising=False)

    llm = LLM(model="tiny-org/tiny-qwen3", num_kv_blocks=32)
    assert Path(llm.engine.config.model).parts[-2:] == ("snapshots", commit)
    local = LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=32)
    prompts = ["Hello, world!", [3, 1, 4, 1, 5]]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in local.generate(prompts, GREEDY, use_tqdm=False)]
    with pytest.raises(ValueError, match="tiny-org/missing"):
        LLM(model="tiny-org/missing")


def run_engine(llm, requests, bad=(), abort_at=None):
    """Add ``requests`` to llm.engine, step; after two steps try ``bad`` ones and abort one.

    Returns the final outputs by request id.
    """
    engine = llm.engine
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, request_id=rid)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 2:
            for prompt, match in bad:
                before = (len(engine.scheduler.waiting), len(engine.scheduler.running), engine.block_manager.num_free_blocks)
                with pytest.raises(ValueError, match=match):
                    engine.add_request(prompt, GREEDY)
                after = (len(engine.scheduler.waiting), len(engine.scheduler.running), engine.block_manager.num_free_blocks)
                assert after == before
            if abort_at is not None:
                seq = engine.requests[abort_at].seq
                held = set(seq.block_table)
                others = {b for s in engine.scheduler.running if s is not seq for b in s.block_table}
                free_before = engine.block_manager.num_free_blocks
                assert engine.abort_request(abort_at)
                assert engine.block_manager.num_free_blocks == free_before + len(held - others)
                assert seq.finish_reason == "abort" and seq.block_table == []
                assert not engine.abort_request(abort_at)  # already gone
                engine.block_manager.check_invariants(list(engine.scheduler.running) + list(engine.scheduler.waiting))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return done


REQUESTS = [
    ("a", [11, 12, 13, 14, 15, 16, 17, 18, 19], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
    ("b", [21, 22, 23], SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)),
    ("c", list(range(30, 60)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    ("d", [7] * 17, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
]


@pytest.fixture(scope="module")
def small_pool_args():
    # 8 blocks of 8 tokens: max_model_len is capped at 64 by the pool.
    return dict(num_kv_blocks=8, block_size=8, max_num_seqs=3)


@pytest.fixture(scope="module")
def clean_run(tiny_qwen3_with_tokenizer, small_pool_args):
    return run_engine(LLM(model=str(tiny_qwen3_with_tokenizer), **small_pool_args), REQUESTS)


def test_bad_requests_leave_the_others_alone(tiny_qwen3_with_tokenizer, small_pool_args, clean_run):
    assert sorted(clean_run) == ["a", "b", "c", "d"]
    llm = LLM(model=str(tiny_qwen3_with_tokenizer), **small_pool_args)
    assert llm.engine.max_model_len == 64
    bad = [
        ([1] * 64, "max_model_len=64"),  # as long as the limit: no room for a token
        ([1] * 100, r"8 blocks x 8 tokens"),  # could never fit in the pool
        ([], "non-empty"),
        ([1, 512], r"\[0, 512\)"),  # outside the vocabulary
        ([-1], r"\[0, 512\)"),
    ]
    engine = llm.engine
    for rid, prompt, params in REQUESTS:
        engine.add_request(prompt, params, request_id=rid)
    with pytest.raises(ValueError, match="request_id 'a'"):
        engine.add_request([1, 2], GREEDY, request_id="a")
    # The same through LLM.generate: a batch with one bad prompt is refused whole.
    with pytest.raises(ValueError, match="prompt 1.*max_model_len"):
        llm.generate([[1, 2, 3], [1] * 70], GREEDY, use_tqdm=False)
    assert len(engine.requests) == 4
    for rid in ("a", "b", "c", "d"):
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()

    # Bad requests arriving mid-run.
    llm = LLM(model=str(tiny_qwen3_with_tokenizer), **small_pool_args)
    done = run_engine(llm, REQUESTS, bad=bad)
    assert done == clean_run


def test_max_model_len_is_enforced(tiny_qwen3_with_tokenizer):
    llm = LLM(model=str(tiny_qwen3_with_tokenizer), num_kv_blocks=64, block_size=8, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len=20"):
        llm.generate([[1] * 20], GREEDY, use_tqdm=False)
    [out] = llm.generate([[1] * 15], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_abort_mid_run(tiny_qwen3_with_tokenizer, small_pool_args, clean_run):
    llm = LLM(model=str(tiny_qwen3_with_tokenizer), **small_pool_args)
    done = run_engine(llm, REQUESTS, abort_at="c")
    assert sorted(done) == ["a", "b", "d"]
    assert {k: done[k] for k in "abd"} == {k: clean_run[k] for k in "abd"}
    # Aborting one still waiting (max_num_seqs=3: "d" was not admitted yet).
    llm = LLM(model=str(tiny_qwen3_with_tokenizer), **small_pool_args)
    for rid, prompt, params in REQUESTS:
        llm.engine.add_request(prompt, params, request_id=rid)
    llm.engine.step()
    assert [s.request_id for s in llm.engine.scheduler.waiting] == ["d"]
    assert llm.engine.abort_request("d")
    assert not llm.engine.abort_request("nonexistent")
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in llm.engine.step() if o.finished})
    assert done == {k: clean_run[k] for k in "abc"}


def test_progress_bar(llm, capsys):
    llm.generate([[1, 2, 3]] * 2, GREEDY, use_tqdm=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    llm.generate([[1, 2, 3]] * 2, GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_bundled_model_is_the_default():
    assert (BUNDLED_MODEL / "config.json").exists() and (BUNDLED_MODEL / "tokenizer.json").exists()
    llm = LLM(num_kv_blocks=64)
    assert Path(llm.engine.config.model) == BUNDLED_MODEL
    [out] = llm.generate(["To be, or not to be"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert out.outputs[0].text.strip()


def test_offline_inference_example_runs():
    """examples/offline_inference.py, as a user would run it, on the bundled model."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offline_inference.py"), "--max-tokens", "12"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "To be, or not to be:" in out
    assert out.count(" tokens, ") == 4  # one line per prompt of the batch
    assert "streaming" in out
    streamed = out.split("streaming", 1)[1].split("\n", 1)[1]
    assert streamed.strip(), "the streamed completion is empty"


def test_stream_with_a_stop_string_sends_nothing_it_takes_back(llm):
    """A stop string can begin in one token's text and end in a later one's; the piece
    that might begin it must not be streamed until it is known not to be a stop string."""
    prompt = "To be, or not to be"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    ends = [len(tok.decode(free.outputs[0].token_ids[: i + 1])) for i in range(len(free.outputs[0].token_ids))]
    text = free.outputs[0].text
    boundary = next(e for e in ends if len(text) // 2 <= e < len(text))
    for stop in (text[boundary - 2 : boundary + 1], text[boundary - 1 : boundary + 2]):  # spanning two tokens
        params = SamplingParams(temperature=0, max_tokens=16, stop=stop)
        [expected] = llm.generate(prompt, params, use_tqdm=False)
        assert expected.outputs[0].finish_reason == "stop"
        assert "".join(llm.stream(prompt, params)) == expected.outputs[0].text, stop


def test_shutdown_frees_the_engine_and_refuses_new_work(tiny_qwen3_with_tokenizer):
    """shutdown() gives back the weights and the KV pool (nothing keeps them alive), drops
    unfinished requests, and every later call says the engine is gone instead of crashing on
    a missing model."""
    import weakref

    llm = LLM(str(tiny_qwen3_with_tokenizer), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8)
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))  # left unfinished
    runner = llm.engine.runner
    kv_cache, weight = weakref.ref(runner.kv_cache), weakref.ref(next(runner.model.parameters()))
    llm.shutdown()
    assert kv_cache() is None and weight() is None
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.engine.step()
    llm.shutdown()  # a second call does nothing


def test_a_batch_with_one_bad_request_queues_none(llm):
    """Every request of a batch is checked against the model before any is queued: a later
    one with a token id outside the vocabulary leaves the engine with nothing to do, and
    the error names the prompt and the field. A prompt that truncate_prompt_tokens brings
    under the limit passes the same check."""
    from minivllm.sampling_params import InvalidParameter

    vocab = llm.engine.runner.model_config.vocab_size
    good, bad = SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logit_bias={vocab + 5: 1.0})
    with pytest.raises(InvalidParameter, match="prompt 1: .*logit_bias") as info:
        llm.generate([[5, 6, 7], [8, 9]], [good, bad], use_tqdm=False)
    assert info.value.param == "logit_bias"
    assert not llm.engine.has_unfinished_requests()
    long_prompt = [5] * (llm.engine.runner.max_model_len + 10)
    out = llm.generate([long_prompt], SamplingParams(max_tokens=2, truncate_prompt_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_generate_runs_with_the_startup_heap_frozen(llm, monkeypatch):
    """Inside generate the garbage collector skips the objects that existed before it (no
    full-heap walk stalls a step) and runs no full collection; after it they are collectable
    again, its thresholds are restored, and a heap frozen by someone else stays frozen."""
    import gc

    from minivllm.bench.throughput import gc_pauses

    seen = []
    step = llm.engine.step

    thresholds = gc.get_threshold()
    full_collection_after = []

    def recording_step():
        seen.append(gc.get_freeze_count())
        full_collection_after.append(gc.get_threshold()[2])
        return step()

    add_request = llm.engine.add_request
    queued_frozen = []

    def recording_add_request(*args, **kwargs):
        # Queueing a few hundred prompts makes enough objects for a full collection: it was
        # where one struck inside a timed run, before the heap was frozen for the steps only.
        queued_frozen.append(gc.get_freeze_count() > 0 and gc.get_threshold()[2] >= 1_000_000)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "step", recording_step)
    monkeypatch.setattr(llm.engine, "add_request", recording_add_request)
    assert gc.get_freeze_count() == 0
    with gc_pauses() as pauses:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        gc.collect()
    assert queued_frozen == [True, True]
    assert seen and min(seen) > 0  # every step ran frozen
    assert min(full_collection_after) >= 1_000_000  # and with full collections held back
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    assert pauses["collections"][2] >= 1 and pauses["longest_seconds"] > 0
    # The full collection's place is recorded (here, the gc.collect() above).
    assert any("test_generate_runs_with_the_startup_heap_frozen" in frame
               for frame in pauses["full_collections_at"][-1])
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        # (Frozen objects are still freed by their reference counts: a few go in the call.)
        assert gc.get_freeze_count() > 0.9 * frozen
    finally:
        gc.unfreeze()


def test_the_step_budget_defaults_to_16384_tokens_on_a_gpu_and_8192_on_the_cpu():
    """As vLLM's LLM class and nano-vllm on a large GPU: an eager prefill step of 16,384
    tokens has twice the device work of one of 8,192 for the same host work."""
    from minivllm.config import EngineConfig

    assert EngineConfig(model="m", device="cuda").max_num_batched_tokens == 16384
    assert EngineConfig(model="m", device="cuda:1").max_num_batched_tokens == 16384
    assert EngineConfig(model="m", device="cpu").max_num_batched_tokens == 8192
    assert EngineConfig(model="m", device="cuda", max_num_batched_tokens=4096).max_num_batched_tokens == 4096
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model="m", device="cuda", max_num_batched_tokens=0)


def test_start_up_says_where_its_time_goes(caplog):
    """Each phase of construction is one line as it ends (on a terminal without logging set
    up, printed to stderr; otherwise logged), with the seconds the runner records for it."""
    import logging

    with caplog.at_level(logging.INFO, logger="minivllm.engine.runner_startup"):
        llm = LLM(num_kv_blocks=16)
    lines = [r.getMessage() for r in caplog.records if r.name == "minivllm.engine.runner_startup"]
    phases = llm.engine.runner.startup_seconds
    assert phases and len(lines) == len(phases)
    for (name, seconds), line in zip(phases.items(), lines):
        assert line == f"start-up: {name.replace('_', ' ')} took {seconds:.1f} s"


@pytest.mark.parametrize("engine_args", [{}, {"async_scheduling": True}, {"async_scheduling": False, "speculative_config": {
    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}])
def test_an_engine_let_go_is_freed_at_once(engine_args):
    """`del llm` frees the engine and its KV pool by reference counting alone, with every
    feature in use (n, prompt logprobs, a grammar, speculation): no reference cycle keeps it
    until the garbage collector's next full pass (on a GPU the next engine would size its
    pool while the old one still held the memory)."""
    import gc
    import weakref

    from minivllm.structured import StructuredOutputsParams

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        llm = LLM(num_kv_blocks=64, **engine_args)
        params = [SamplingParams(max_tokens=4)]
        if "speculative_config" not in engine_args:  # (speculation refuses the other features yet)
            params += [SamplingParams(max_tokens=4, n=2), SamplingParams(max_tokens=4, prompt_logprobs=1),
                       SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))]
        llm.generate([[1, 2, 3]] * len(params), params, use_tqdm=False)
        engine, kv_cache = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_cache)
        del llm
        assert engine() is None and kv_cache() is None
    finally:
        if was_enabled:
            gc.enable()
