"""The engine on a CUDA GPU: Triton kernels and CUDA graphs against transformers.

Marked gpu: `make test` deselects them on the CPU; scripts/gpu_check.sh runs them.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.engine.cuda_graphs import DECODE, PREFILL, SCRATCH
from minivllm.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in torch.randint(2, 300, (24,), generator=g)]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device=model.device)
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_float32_greedy_identical_to_transformers(tmp_path, prompts, enforce_eager):
    """float32 on the GPU: the kernels use true float32 dot products, so greedy decoding is
    token for token the same as transformers', with CUDA graphs and without."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_tiny_checkpoint(tmp_path, seed=5, max_position_embeddings=1024)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    llm = LLM(str(path), dtype="float32", enforce_eager=enforce_eager, gpu_memory_utilization=0.3,
              block_size=16, max_num_batched_tokens=512, record_trace=True)
    assert bool(llm.engine.runner.graphs) != enforce_eager
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 48)
    assert any(len(s.seqs) > 1 and all(k == "decode" for *_, k in s.seqs) for s in llm.engine.trace)
    llm.shutdown()  # its KV pool back now: the engine's parts refer to each other, so `del` waits for the collector


def test_bfloat16_logits_close_to_transformers(tmp_path):
    """bfloat16: first-token logits agree with transformers' bf16 within bf16 rounding of
    O(1) logits summed over a few layers (atol 0.1), and the top token agrees."""
    path = make_tiny_checkpoint(tmp_path, seed=6, dtype=torch.bfloat16, hidden_size=256, intermediate_size=768,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_hidden_layers=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.3)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (200,), generator=g).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float().log_softmax(-1)
    top = ref.topk(5)
    ours = out.outputs[0].logprobs[0]
    assert out.outputs[0].token_ids[0] == int(top.indices[0])
    for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
        assert tid in ours and abs(ours[tid].logprob - lp) < 0.1
    llm.shutdown()


def test_cuda_graphs_pad_odd_batch_sizes(tmp_path):
    """Batches of 3, 5 and 17 sequences replay the graphs captured for 4, 8 and 32, with
    padding rows that store nothing and attend to nothing: tokens equal the eager run's
    (float32, so split-order rounding cannot flip a greedy choice)."""
    path = make_tiny_checkpoint(tmp_path, seed=8, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(1)
    for n in (3, 5, 17):
        batch = [torch.randint(0, 512, (int(k),), generator=g).tolist() for k in torch.randint(2, 200, (n,), generator=g)]
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        results = []
        for eager in (False, True):
            llm = LLM(str(path), dtype="float32", enforce_eager=eager, gpu_memory_utilization=0.1)
            results.append([o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)])
            if not eager:
                # Every prompt fits one prefill step (under 8,192 tokens), then all n
                # sequences decode together: 19 steps, each replaying the padded graph.
                replays = llm.engine.runner.cudagraphs.replays_of(DECODE)
                padded = {3: 4, 5: 8, 17: 32}[n]
                assert replays[padded] == 19 and sum(replays.values()) == 19, replays
            llm.shutdown()
        assert results[0] == results[1]


def test_prefill_graphs_replay_one_sequence_steps(tmp_path):
    """A step computing one sequence (a prompt, a chunk after a cached prefix) replays the
    prefill graph of the next captured token count, its padding rows storing nothing: the
    tokens and the prompt logprobs equal the eager run's (float32), for prompts on both
    sides of a captured size and one past the largest, which runs eagerly."""
    path = make_tiny_checkpoint(tmp_path, seed=10, max_position_embeddings=2048)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 100, 700)]
    prompts += [shared + [7, 8, 9], shared + [10, 11]]  # the second reuses the first's cached blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    results = []
    for eager in (False, True):
        llm = LLM(str(path), dtype="float32", enforce_eager=eager, gpu_memory_utilization=0.1,
                  max_num_batched_tokens=512)  # the 700-token prompt: a graphed chunk of 512, then 188
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one at a time
        results.append(([o.outputs[0].token_ids for o in outs],
                        [[max(d.values(), key=lambda x: x.logprob).logprob if d else None for d in o.prompt_logprobs]
                         for o in outs]))
        if not eager:
            assert llm.engine.runner.cudagraphs.dispatcher.sizes[PREFILL][-1] == 512
            replays = llm.engine.runner.cudagraphs.replays_of(PREFILL, SCRATCH)  # a size's graph or its twin
            assert replays[16] >= 2 and replays[32] >= 1 and replays[128] >= 1 and replays[512] >= 1, replays
        llm.shutdown()  # its KV pool back before the next engine sizes its own
    assert results[0][0] == results[1][0]
    for got, want in zip(results[0][1], results[1][1]):
        assert [x is None for x in got] == [x is None for x in want]
        assert all(a is None or abs(a - b) < 1e-4 for a, b in zip(got, want))


def test_prompts_from_scratch_replay_their_own_prefill_graphs(tmp_path, monkeypatch):
    """bfloat16: a one-sequence prompt from scratch of 512 tokens or more replays the twin
    of its prefill graph whose attention reads only the step's own keys (FROM_SCRATCH); a
    chunk after a cached prefix replays the general graph. Greedy tokens equal those of an
    engine whose prefill gathers every key through the block table, on CUDA graphs too: an
    eager engine's decode steps cut the context into other splits than a graph's (sized for
    max_model_len), and in bfloat16 that alone flips this random model's near-ties."""
    from minivllm.kernels import paged_attention

    path = make_tiny_checkpoint(tmp_path, seed=12, dtype=torch.bfloat16, max_position_embeddings=2048)
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(0, 512, (640,), generator=g).tolist()
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (600, 1000, 513)]
    prompts += [shared, shared + torch.randint(0, 512, (300,), generator=g).tolist()]  # the last: 640 cached
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.1, max_num_batched_tokens=1024)
    graphed = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    graphs = llm.engine.runner.cudagraphs
    assert graphs.dispatcher.sizes[SCRATCH] == [512, 768, 1024]
    twins = graphs.replays_of(SCRATCH)
    assert twins[768] >= 2 and twins[1024] >= 1, twins
    assert graphs.replays_of(PREFILL)[512] > 0, "the cached chunk: the general graph"
    llm.shutdown()
    default = paged_attention.prefill_config
    monkeypatch.setattr(paged_attention, "prefill_config", lambda *a, **k: {**default(*a, **k), "NEW_KV": False})
    llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.1, max_num_batched_tokens=1024)
    gathered = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert llm.engine.runner.cudagraphs.replays_of(SCRATCH)[768] >= 2  # the twins again, now gathering
    llm.shutdown()
    assert graphed == gathered


def test_kv_pool_sized_from_measured_memory(tmp_path):
    path = make_tiny_checkpoint(tmp_path, seed=9, dtype=torch.bfloat16)
    small = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.1, enforce_eager=True)
    n_small = small.engine.runner.num_kv_blocks
    small.shutdown()  # (a `del` would leave its pool to the garbage collector's next full pass)
    large = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.2, enforce_eager=True)
    n_large = large.engine.runner.num_kv_blocks
    total = torch.cuda.get_device_properties(0).total_memory
    block = large.engine.runner.block_bytes
    # Doubling the share adds about 10% of the card's memory worth of blocks.
    assert abs((n_large - n_small) * block - 0.1 * total) < 0.02 * total
    large.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_n_completions_fork_the_prompt_on_the_gpu(tmp_path, async_scheduling):
    """SamplingParams.n on the GPU (copy on write of the shared block through the device's KV
    pool, CUDA graphs, asynchronous scheduling or not): each completion is what a separate
    request with seed + i gives (float32, so a different batch cannot flip a draw)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_tiny_checkpoint(tmp_path, seed=12, max_position_embeddings=1024)
    llm = LLM(str(path), dtype="float32", gpu_memory_utilization=0.1, block_size=16,
              async_scheduling=async_scheduling)
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(3)).tolist()  # a partial block
    [out] = llm.generate([prompt], SamplingParams(n=5, temperature=1.0, seed=21, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)
    separate = llm.generate([prompt] * 5, [SamplingParams(temperature=1.0, seed=21 + i, max_tokens=40,
                                                          ignore_eos=True) for i in range(5)], use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in separate]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.shutdown()


def test_step_keys_read_in_bulk_give_the_same_tokens(tmp_path, monkeypatch):
    """bfloat16, where prefill reads the step's own keys and values through tensor
    descriptors (NEW_KV): greedy tokens equal those of the same engine with every key
    gathered through the block table, over prompts from scratch, prompts after a cached
    prefix and chunks of a long one (eager, so both runs launch the kernel they configure)."""
    from minivllm.kernels import paged_attention

    path = make_tiny_checkpoint(tmp_path, seed=11, dtype=torch.bfloat16, max_position_embeddings=2048)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 512, (200,), generator=g).tolist()
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (30, 129, 700)]
    prompts += [shared + torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 70, 300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    default, describe = paged_attention.prefill_config, paged_attention.step_kv_descriptor
    assert default(128, 2)["NEW_KV"] and default(64, 4)["NEW_KV"]
    made = []  # the descriptors the kernel got: the engine's K and V must be ones it can describe
    monkeypatch.setattr(paged_attention, "step_kv_descriptor", lambda *a: made.append(describe(*a)) or made[-1])
    results = []
    for new_kv in (True, False):
        monkeypatch.setattr(paged_attention, "prefill_config", lambda *a, **k: {**default(*a, **k), "NEW_KV": new_kv})
        llm = LLM(str(path), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.1, max_num_batched_tokens=256)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
        if new_kv:
            assert made and all(d is not None for d in made), f"{sum(d is None for d in made)} of {len(made)} not described"
    assert results[0] == results[1]
