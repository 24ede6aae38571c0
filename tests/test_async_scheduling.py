"""Asynchronous scheduling (chapter 17): the engine puts step N+1 on the device before it
takes in step N's tokens, and every output must be what the synchronous loop gives, token
for token: greedy, seeded, with chunked prefill, preemption, prefix caching, stop strings,
min_tokens, logprobs, aborts, streaming and hybrid state slots.

On a CPU nothing runs beside the host, so these tests check the bookkeeping (tokens that
are still "on the device", inputs filled from the previous step's samples, a finished
sequence's wasted step), which is all that can go wrong; the GPU check measures the gain.
"""
import asyncio
import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.server import AsyncLLMEngine
from minivllm.testing import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("async"), family="qwen3", seed=11, with_tokenizer=True)


def engines(checkpoint, **args):
    """The same engine twice: synchronous and asynchronous."""
    return [LLM(str(checkpoint), async_scheduling=a, **args) for a in (False, True)]


def workload(seed: int, n: int = 24, shared_prefix: bool = True):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(20)] if shared_prefix else []
    prompts = [prefix[: rng.randint(0, 20)] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))]
               for _ in range(n)]
    params = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=30, logprobs=3))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(1000), max_tokens=25))
        elif kind == 3:
            params.append(SamplingParams(temperature=0, max_tokens=35, min_tokens=10))
        elif kind == 4:
            params.append(SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=20, stop_token_ids=[7, 8]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=None))  # until EOS or the context's end
    return prompts, params


def same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
        assert x.outputs[0].stop_reason == y.outputs[0].stop_reason
        # (Not num_cached_tokens: blocks are hashed once their tokens are on the host, a step
        # later when asynchronous, so a request admitted meanwhile may find fewer of them.)
        if x.outputs[0].logprobs is not None:
            # The same tokens with the same ranks; the values to rounding (a step's batch can
            # differ when the pool is tight, and float sums with it).
            for e, f in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
                assert {t: lp.rank for t, lp in e.items()} == {t: lp.rank for t, lp in f.items()}
                assert [lp.logprob for lp in e.values()] == pytest.approx([lp.logprob for lp in f.values()], abs=1e-4)


@pytest.mark.parametrize("engine_args", [
    dict(num_kv_blocks=512, block_size=8),  # roomy: plain continuous batching, prefix hits
    dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=8),  # chunking and preemption
], ids=["roomy", "tight"])
def test_outputs_identical_with_and_without(checkpoint, engine_args):
    sync, asyn = engines(checkpoint, record_trace=True, **engine_args)
    prompts, params = workload(0)
    want = sync.generate(prompts, params, use_tqdm=False)
    got = asyn.generate(prompts, params, use_tqdm=False)
    same(want, got)
    assert any(o.outputs[0].finish_reason == "stop" for o in want), "no request stopped early: a weak workload"
    if "max_num_batched_tokens" in engine_args:
        assert any(r.preempted for r in asyn.engine.trace), "the tight pool never preempted"
    else:  # the same prompts again: their blocks are in the prefix cache now
        again = [asyn.generate(prompts[:8], params[:8], use_tqdm=False),
                 sync.generate(prompts[:8], params[:8], use_tqdm=False)]
        same(*again)
        assert all(o.num_cached_tokens for o in again[0] if len(o.prompt_token_ids) > 8), "no prefix-cache hit"
    for llm in (sync, asyn):
        bm = llm.engine.block_manager
        assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
        # The step trace names every sequence once among the finished (the overlapped loop's
        # last call takes a step in and launches none: its finishes join the last record).
        finished = [s for r in llm.engine.trace for s in r.finished]
        assert len(finished) == len(set(finished)) >= len(prompts), f"finished in the trace: {sorted(finished)}"


def test_stop_strings_identical(checkpoint):
    sync, asyn = engines(checkpoint, num_kv_blocks=256, block_size=8)
    prompt = "The quick brown fox"
    [full] = sync.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    text = full.outputs[0].text
    stops = [text[8:11], text[20:22] or "zz"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stops, min_tokens=2)
    same(sync.generate([prompt] * 3, params, use_tqdm=False), asyn.generate([prompt] * 3, params, use_tqdm=False))
    streamed_sync = "".join(sync.stream(prompt, params))
    streamed_async = "".join(asyn.stream(prompt, params))
    assert streamed_sync == streamed_async and streamed_async


def test_the_token_stays_on_the_device_until_the_next_step(checkpoint):
    """What makes it asynchronous: after a step the sampled token is not in token_ids yet
    (it is pending), the next step reads it on the device, and outputs arrive one step late."""
    sync, asyn = engines(checkpoint, num_kv_blocks=128, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for llm in (sync, asyn):
        llm.engine.add_request([5, 6, 7, 8], params, request_id="r")
    seq_sync, seq_async = sync.engine.requests["r"].seq, asyn.engine.requests["r"].seq
    sync.engine.step()
    assert seq_sync.num_output_tokens == 1 and seq_sync.num_pending == 0
    assert asyn.engine.step() == []
    assert seq_async.num_output_tokens == 0 and seq_async.num_pending == 1  # sampled, still on the device
    asyn.engine.step()  # the decode reads that token on the device; then the host takes it in
    assert seq_async.num_output_tokens == 1 and seq_async.num_pending == 1
    outs = []
    while asyn.engine.has_unfinished_requests():
        outs += asyn.engine.step()
    while sync.engine.has_unfinished_requests():
        sync.engine.step()
    assert [o.outputs[0].token_ids for o in outs] == [seq_sync.output_token_ids]
    assert asyn.engine.num_steps == sync.engine.num_steps  # max_tokens is known: no wasted step


def test_aborts_while_a_step_is_in_flight_free_everything(checkpoint):
    _, asyn = engines(checkpoint, num_kv_blocks=64, block_size=4, max_num_seqs=6)
    engine = asyn.engine
    rng = random.Random(3)
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    for i in range(30):
        engine.add_request([rng.randrange(3, 500) for _ in range(rng.randint(2, 30))], params, request_id=f"r{i}")
    live = [f"r{i}" for i in range(30)]
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished.add(out.request_id)
        if live and rng.random() < 0.4:
            victim = live.pop(rng.randrange(len(live)))
            engine.abort_request(victim)
        engine.block_manager.check_invariants(engine.scheduler.running)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests
    assert finished, "nothing finished"


def test_hybrid_state_slots_identical(hybrid_checkpoint):
    path = hybrid_checkpoint("qwen3_5")
    sync, asyn = (LLM(str(path), async_scheduling=a, num_kv_blocks=128, block_size=8, max_num_batched_tokens=24,
                      max_num_seqs=4) for a in (False, True))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 40))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 12), ignore_eos=True) for _ in prompts]
    same(sync.generate(prompts, params, use_tqdm=False), asyn.generate(prompts, params, use_tqdm=False))


def test_the_served_loop_gives_the_same_tokens(checkpoint):
    sync, asyn = engines(checkpoint, num_kv_blocks=256, block_size=8)
    prompts, params = workload(7, n=12)
    want = sync.generate(prompts, params, use_tqdm=False)
    engine = AsyncLLMEngine(asyn.engine)

    async def one(prompt, p):
        last = None
        async for last in engine.generate(prompt, p):
            pass
        return last

    async def run():
        try:
            return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params)))
        finally:
            await engine.shutdown()

    same(want, asyncio.run(run()))


def test_tensor_parallelism_refuses_async_scheduling(checkpoint):
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(checkpoint), tensor_parallel_size=2, async_scheduling=True)


@pytest.mark.gpu
def test_gpu_asynchronous_steps_follow_each_other_on_the_device():
    """Chapter 17's claim, on a GPU: in the synchronous loop the device idles between decode
    steps while the host takes in the tokens and prepares the next step; asynchronously the
    next step is queued before the host takes in the last, so the device's spans of
    consecutive steps (the profiler's device-side ``minivllm.launch`` ranges) leave no gap."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    from minivllm.bench.throughput import model_checkpoint

    path = model_checkpoint()  # Qwen3-0.6B's shapes: a step long enough to hide the host behind
    gaps = {}
    for mode in (False, True):
        llm = LLM(str(path), async_scheduling=mode, gpu_memory_utilization=0.3)
        try:
            engine, g = llm.engine, torch.Generator().manual_seed(0)
            params = SamplingParams(temperature=0.6, max_tokens=100, ignore_eos=True)
            for _ in range(64):
                engine.add_request(torch.randint(3, 150_000, (256,), generator=g).tolist(), params)
            for _ in range(4):  # past the prefill
                engine.step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(6):
                    engine.step()
                torch.cuda.synchronize()
        finally:
            llm.shutdown()
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.name == "minivllm.launch")
        assert len(spans) == 6, f"expected the device-side ranges of 6 launches, found {len(spans)}"
        gaps[mode] = statistics.median(b[0] - a[1] for a, b in zip(spans, spans[1:]))  # microseconds
    assert gaps[True] < 100, f"asynchronous: a median {gaps[True]:.0f} us between one step's work and the next's"
    assert gaps[False] > 200, f"synchronous: only {gaps[False]:.0f} us between steps; is the host that fast?"


@pytest.mark.gpu
def test_gpu_staged_uploads_arrive_intact_through_every_buffer():
    """Asynchronous scheduling uploads each step through a ring of pinned buffers made at
    start-up (``PinnedStaging``): more uploads than buffers, each of fresh random values into
    buffers poisoned first, arrive as they were sent; an array longer than a buffer is left to
    the caller (None)."""
    import torch

    from minivllm.engine.step_inputs import PinnedStaging

    staging = PinnedStaging(1000, num_buffers=3)
    for buffer in staging.buffers:
        buffer.fill_(-7)
    g = torch.Generator().manual_seed(0)
    sent, arrived = [], []
    for n in (1000, 17, 640, 3, 999, 1, 512):
        host = torch.randint(-2**40, 2**40, (n,), generator=g, dtype=torch.int64)
        sent.append(host.clone())
        arrived.append(staging.upload(host, torch.device("cuda")))
        host.fill_(0)  # the caller's array is free again as soon as upload returns
    torch.cuda.synchronize()
    for a, b in zip(sent, arrived):
        assert torch.equal(a, b.cpu())
    two_rows = torch.arange(20, dtype=torch.int64).view(2, 10)
    assert torch.equal(staging.upload(two_rows, torch.device("cuda")).cpu(), two_rows)
    assert staging.upload(torch.zeros(1001, dtype=torch.int64), torch.device("cuda")) is None
