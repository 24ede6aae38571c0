"""Tensor parallelism on the CPU: gloo, 2 processes, float32.

- the shard rules (rows, KV heads, vocabulary) and the sharded layers in one process
  (``as_rank`` builds rank r's layer): the ranks' partial results add up to the full matmul;
- the same layers in 2 real processes with real all-reduces and all-gathers;
- every family's logits at tensor_parallel_size=2 against 1 (also with fewer KV heads
  than ranks, a vocabulary that does not divide, and Qwen3-MoE's experts);
- the engine, dense and MoE: LLM(tensor_parallel_size=2) gives the greedy tokens of LLM()
  (and their log-probs), bad sizes are refused before any process starts, shutdown leaves
  nothing.

Tolerance: the split matmuls add the same float32 products in another order (the
all-reduce sums two partial dot products), a few ulps on O(1) values: 1e-5 absolute.
"""
import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context
from minivllm.distributed import parallel_state
from minivllm.distributed.launch import run_on_ranks
from minivllm.distributed.parallel_state import all_gather, all_reduce, as_rank
from minivllm.layers.embed_head import LMHead, VocabEmbedding, masked_embedding
from minivllm.layers.linear import (ColumnParallelLinear, GateUpLinear, QKVLinear, RowParallelLinear,
                                    kv_head_range, split_rows)
from minivllm.layers.moe import StackedExperts
from minivllm.loader import load_model
from minivllm.testing import make_tiny_checkpoint, torch_threads

ATOL = 1e-5


# -- shard rules ----------------------------------------------------------------------------

def test_split_rows():
    assert [split_rows(12, r, 3) for r in range(3)] == [(0, 4), (4, 4), (8, 4)]
    assert split_rows(7, 0, 1) == (0, 7)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        split_rows(7, 0, 2)


def test_kv_heads_split_or_replicated():
    assert [kv_head_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # Fewer KV heads than ranks: each rank keeps the one head its query heads use.
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    num_heads, num_kv = 8, 2
    for rank in range(4):
        first_q, count_q = split_rows(num_heads, rank, 4)
        kv_first, _ = kv_head_range(num_kv, rank, 4)
        assert {h // (num_heads // num_kv) for h in range(first_q, first_q + count_q)} == {kv_first}
    with pytest.raises(ValueError, match="num_key_value_heads"):
        kv_head_range(2, 0, 3)


# -- sharded layers, one process -------------------------------------------------------------

def _column_and_row(w1, w2, b2):
    """A column-parallel layer then a row-parallel one, as this rank builds and loads them."""
    col = ColumnParallelLinear(w1.shape[1], w1.shape[0])
    row = RowParallelLinear(w2.shape[1], w2.shape[0], bias=True)
    col.weight_loader(col.weight, w1)
    row.weight_loader(row.weight, w2)
    row.weight_loader(row.bias, b2)
    return col, row


def _layers_of_rank(rank, world_size, w1, w2, b2):
    with as_rank(rank, world_size):
        return _column_and_row(w1, w2, b2)


def test_column_then_row_partials_sum_to_the_full_matmul():
    w1, w2, b2, x = torch.randn(24, 16), torch.randn(16, 24), torch.randn(16), torch.randn(5, 16)
    full = F.linear(F.linear(x, w1), w2, b2)
    for world_size in (1, 2, 4):
        partials = []
        for rank in range(world_size):
            col, row = _layers_of_rank(rank, world_size, w1, w2, b2)
            start, size = split_rows(24, rank, world_size)
            assert torch.equal(col.weight, w1[start : start + size])
            assert torch.equal(row.weight, w2[:, start : start + size])
            assert torch.equal(row.bias, b2)  # not split: added once, after the sum
            partials.append(F.linear(col(x), row.weight))
        torch.testing.assert_close(sum(partials) + b2, full, atol=ATOL, rtol=1e-5)


def test_qkv_and_gate_up_shards():
    hidden, d, heads, kv = 8, 4, 4, 2
    q, k, v = torch.randn(heads * d, hidden), torch.randn(kv * d, hidden), torch.randn(kv * d, hidden)
    for world_size in (2, 4):  # 4 ranks > 2 KV heads: KV replicated
        for rank in range(world_size):
            with as_rank(rank, world_size):
                qkv = QKVLinear(hidden, d, heads, kv, bias=False)
            for shard_id, w in zip("qkv", (q, k, v)):
                qkv.weight_loader(qkv.weight, w, shard_id)
            q0, nq = split_rows(heads, rank, world_size)
            k0, nk = kv_head_range(kv, rank, world_size)
            assert (qkv.num_heads, qkv.num_kv_heads) == (nq, nk)
            expected = torch.cat([q[q0 * d : (q0 + nq) * d], k[k0 * d : (k0 + nk) * d], v[k0 * d : (k0 + nk) * d]])
            assert torch.equal(qkv.weight, expected)
    gate, up = torch.randn(12, hidden), torch.randn(12, hidden)
    with as_rank(1, 2):
        gate_up = GateUpLinear(hidden, 12)
    gate_up.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight_loader(gate_up.weight, up, 1)
    assert torch.equal(gate_up.weight, torch.cat([gate[6:], up[6:]]))
    with pytest.raises(ValueError, match=r"shard 'q': expected shape \(16, 8\)"):
        qkv.weight_loader(qkv.weight, q[:8], "q")


@pytest.mark.parametrize("vocab", [12, 10])  # 10 over 4 ranks: 3 rows each, the last 2 are padding
def test_vocab_parallel_embedding_and_head(vocab):
    table, ids, h = torch.randn(vocab, 6), torch.tensor([0, 3, vocab - 1, 5, 2]), torch.randn(3, 6)
    lookups, logits = [], []
    for rank in range(4):
        with as_rank(rank, 4):
            embed = VocabEmbedding(vocab, 6)
            head = LMHead(vocab, 6)
        embed.weight_loader(embed.weight, table)
        head.weight_loader(head.weight, table)
        lookups.append(masked_embedding(ids, embed.weight, embed.vocab_start))
        logits.append(F.linear(h, head.weight))
    assert torch.equal(sum(lookups), F.embedding(ids, table))  # exactly one rank contributes each row
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], h @ table.T, atol=ATOL, rtol=0)


def test_expert_shards_from_either_checkpoint_layout():
    """Each rank keeps a slice of every expert's features, whether the checkpoint stores the
    experts one by one or stacked ([E, 2I, H] gate rows then up rows; [E, H, I])."""
    E, H, I = 3, 4, 8
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    for rank in range(2):
        with as_rank(rank, 2):
            one_by_one, stacked = StackedExperts(E, H, I), StackedExperts(E, H, I)
        for e in range(E):
            one_by_one.weight_loader(one_by_one.gate_up_proj, gate[e], (e, 0))
            one_by_one.weight_loader(one_by_one.gate_up_proj, up[e], (e, 1))
            one_by_one.weight_loader(one_by_one.down_proj, down[e], (e, None))
        stacked.weight_loader(stacked.gate_up_proj, torch.cat([gate, up], dim=1))
        stacked.weight_loader(stacked.down_proj, down)
        mine = slice(rank * 4, rank * 4 + 4)
        for experts in (one_by_one, stacked):
            assert torch.equal(experts.gate_up_proj, torch.cat([gate[:, mine], up[:, mine]], dim=1))
            assert torch.equal(experts.down_proj, down[:, :, mine])
    with pytest.raises(ValueError, match=r"expert 1: expected shape \(4, 8\)"):
        one_by_one.weight_loader(one_by_one.down_proj, down[1, :, :4], (1, None))


def test_collectives_without_a_group():
    x = torch.randn(3)
    assert all_reduce(x) is x and all_gather(x) is x  # world size 1: identity
    with as_rank(0, 2), pytest.raises(RuntimeError, match="needs a process group"):
        all_reduce(x)
    assert parallel_state.get_tp_world_size() == 1


# -- the same layers in two processes, with real collectives ----------------------------------

def _layers_with_collectives(w1, w2, b2, table, x, ids):
    """On each rank: this rank's shards, the real forward with its all-reduce / all-gather."""
    col, row = _column_and_row(w1, w2, b2)
    embed, head = VocabEmbedding(*table.shape), LMHead(*table.shape)
    embed.weight_loader(embed.weight, table)
    head.weight_loader(head.weight, table)
    return row(col(x)), embed(ids), head(x)


def test_layers_in_two_processes():
    w1, w2, b2, table = torch.randn(24, 16), torch.randn(16, 24), torch.randn(16), torch.randn(10, 16)
    x, ids = torch.randn(5, 16), torch.tensor([9, 0, 4, 5, 3])
    results = run_on_ranks(_layers_with_collectives, 2, w1, w2, b2, table, x, ids, num_threads=1)
    for mlp, rows, logits in results:  # every rank ends with the full results
        torch.testing.assert_close(mlp, F.linear(F.linear(x, w1), w2, b2), atol=ATOL, rtol=0)
        assert torch.equal(rows, F.embedding(ids, table))
        torch.testing.assert_close(logits, x @ table.T, atol=ATOL, rtol=0)


# -- whole models: tensor_parallel_size=2 against 1 -------------------------------------------

CHECKPOINTS = {
    "qwen3": dict(family="qwen3"),  # 2 KV heads over 2 ranks: split; tied head
    "qwen3-one-kv-head": dict(family="qwen3", num_key_value_heads=1),  # replicated KV head
    "qwen2-odd-vocab": dict(family="qwen2", vocab_size=509, tie_word_embeddings=False),  # biases; padded vocab
    "llama": dict(family="llama", tie_word_embeddings=False),
    "gemma3": dict(family="gemma3"),
    "qwen3_moe": dict(family="qwen3_moe"),  # 8 experts, each split by its intermediate features
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: make_tiny_checkpoint(tmp_path_factory.mktemp(name), seed=3, **kw) for name, kw in CHECKPOINTS.items()}


def _model_logits(paths, ids):
    out = {}
    for name, path in paths.items():
        model = load_model(path)
        reset_context()
        with torch.inference_mode():
            out[name] = model.compute_logits(model(ids, torch.arange(len(ids))), all_tokens=True)
    return out


def test_model_logits_match_one_process(checkpoints):
    ids = torch.randint(0, 509, (37,))
    with torch_threads(1):
        reference = _model_logits(checkpoints, ids)
    for per_rank in run_on_ranks(_model_logits, 2, checkpoints, ids, num_threads=1):
        for name, logits in per_rank.items():
            torch.testing.assert_close(logits, reference[name], atol=ATOL, rtol=0, msg=name)


# -- the engine ---------------------------------------------------------------------------------

ENGINE_ARGS = dict(dtype="float32", num_kv_blocks=120, block_size=8, max_num_batched_tokens=64)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_engine_greedy_matches_one_process(checkpoints, name):
    """Batched, chunked (budget 64), prefix-cached (shared prefix) and paged: the same tokens."""
    path = str(checkpoints[name])
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 512, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (1, 50, 9)]
    prompts += [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 130)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    scoring = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)  # every rank runs the LM head on them
    with torch_threads(1):
        one = LLM(path, **ENGINE_ARGS)
        reference = one.generate(prompts, params, use_tqdm=False)
        scored_reference = one.generate(prompts[1:], scoring, use_tqdm=False)
        one.shutdown()
        llm = LLM(path, tensor_parallel_size=2, **ENGINE_ARGS)
        workers = llm.engine.runner.workers
        try:
            assert parallel_state.get_tp_world_size() == 2
            assert llm.engine.runner.model.model.layers[0].self_attn.num_heads == 2  # half of the 4 heads
            outputs = llm.generate(prompts, params, use_tqdm=False)
            # A second round reuses the same workers (and hits the prefix cache).
            again = llm.generate(prompts[:2], params, use_tqdm=False)
            scored = llm.generate(prompts[1:], scoring, use_tqdm=False)
        finally:
            llm.shutdown()
    for ref, out in zip(reference + reference[:2], outputs + again):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)
    assert sum(o.num_cached_tokens for o in outputs) > 0
    for ref, out in zip(scored_reference, scored):
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for e, f in zip(ref.prompt_logprobs[1:], out.prompt_logprobs[1:], strict=True):
            assert {t: lp.rank for t, lp in e.items()} == {t: lp.rank for t, lp in f.items()}
            assert [lp.logprob for lp in e.values()] == pytest.approx([lp.logprob for lp in f.values()], abs=1e-4)
    assert not any(w.is_alive() for w in workers)
    assert parallel_state.get_tp_world_size() == 1  # back to a plain single process


def test_bad_sizes_are_refused_before_any_process_starts(checkpoints):
    path = str(checkpoints["qwen3"])  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads"):
        LLM(path, tensor_parallel_size=3, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be an int >= 1"):
        LLM(path, tensor_parallel_size=0, **ENGINE_ARGS)
    assert parallel_state.get_tp_world_size() == 1


def test_hybrid_models_are_refused(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path / "qwen3_5", family="qwen3_5"))
    with pytest.raises(ValueError, match="hybrid models .* run on one device only"):
        LLM(path, tensor_parallel_size=2, **ENGINE_ARGS)
    assert parallel_state.get_tp_world_size() == 1


@pytest.mark.gpu
def test_bf16_tensor_parallel_matches_one_gpu(tmp_path):
    """Two GPUs, NCCL, bfloat16: greedy tokens of tp=2 against tp=1 on a random model with
    real head counts. bf16 rounds each rank's partial sum before the all-reduce, so a few
    near-ties may flip late in a sequence: the first 8 tokens of every prompt must match,
    and 90% of all tokens."""
    if torch.cuda.device_count() < 2:
        pytest.fail("this test needs 2 CUDA GPUs")
    path = make_tiny_checkpoint(tmp_path / "m", dtype=torch.bfloat16, init_std=0.02, vocab_size=4096, hidden_size=512,
                                intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=4, head_dim=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in (5, 100, 300, 31)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    one = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.3)
    reference = one.generate(prompts, params, use_tqdm=False)
    # Give the GPU back before rank 0 sizes its KV pool: it would otherwise count this
    # engine's memory as in use, find no room, and fail to start.
    one.shutdown()
    llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.3, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.graphs  # CUDA graphs with the all-reduces inside
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    same = total = 0
    for ref, out in zip(reference, outputs):
        a, b = ref.outputs[0].token_ids, out.outputs[0].token_ids
        assert a[:8] == b[:8]
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
    assert same >= 0.9 * total


def test_rank_zero_leaves_the_group_before_waiting_for_workers(monkeypatch):
    """Under NCCL each rank's destroy_process_group waits for every other rank's: if rank 0
    joined its workers first, each side would wait for the other (on the H200 every shutdown
    stalled for the 30 s join timeout). So _stop must send None, leave, and only then join;
    and with a worker already dead it must abort, since nobody will leave with it."""
    from minivllm.engine import tp_worker

    calls = []

    class FakeWorker:
        def __init__(self, alive):
            self.alive = alive

        def is_alive(self):
            return self.alive

        def join(self, timeout=None):
            calls.append("join")
            self.alive = False  # it exited

    class FakeQueue:
        def put(self, item):
            calls.append(("put", item))

    monkeypatch.setattr(tp_worker, "destroy_tensor_parallel", lambda abort=False: calls.append(("leave", abort)))
    tp_worker._stop([FakeWorker(True), FakeWorker(True)], [FakeQueue(), FakeQueue()])
    assert calls == [("put", None), ("put", None), ("leave", False), "join", "join"]

    calls.clear()
    tp_worker._stop([FakeWorker(True), FakeWorker(False)], [FakeQueue(), FakeQueue()])
    assert calls == [("put", None), ("leave", True), "join", "join"]
