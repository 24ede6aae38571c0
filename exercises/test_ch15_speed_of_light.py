"""Chapter 15 — speed of light: the floor time of the engine's real steps.

Your step floor inside ``speed_of_light`` (exercises/minivllm/bench/throughput.py) is given
step records like the engine's trace and ceilings chosen so that big prefill steps are
compute-bound and decode steps memory-bound, and its totals and floor are compared with the
roofline written out here: bytes = every weight once + the K/V the step reads; FLOPs = 2 per
weight per token (the vocabulary matrix only for the sampled rows) + 4 per (query, key) pair
per head and dimension; floor = the sum over steps of max(bytes / bandwidth, FLOPs / rate).
A floor of the totals, a sum of the two times, a forgotten K/V read or dtype size, or a head
charged for every token all come out measurably different. Last, the same on the trace of a
real (tiny) engine run. And the two counts each step record carries, from a scheduled batch
(``attention_work`` in exercises/minivllm/engine/trace.py).
"""
from types import SimpleNamespace

import pytest
import torch

from minivllm.bench.throughput import speed_of_light
from minivllm.engine.trace import StepRecord

CONFIG = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=8, head_dim=16,
                         vocab_size=1000, hidden_size=64)
PARAMS = 1_000_000  # 64,000 of them the embedding (vocab x hidden), the rest the body
CEILINGS = {"copy_bandwidth_bytes_per_s": 1e9, "bf16_matmul_flops_per_s": 1e11}


def step(seqs, kv_tokens_read, attention_pairs, i=0):
    return StepRecord(step=i, seqs=seqs, blocks_in_use=0, num_blocks=0, cache_hit_tokens=0, preempted=[], finished=[],
                      seconds=0.0, kv_tokens_read=kv_tokens_read, attention_pairs=attention_pairs)


def roofline(trace, c, params, ceilings, dtype_bytes):
    """(bytes, FLOPs, seconds) of each step, written out long-hand."""
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * dtype_bytes  # K and V, every layer
    embed = c.vocab_size * c.hidden_size
    rows = []
    for s in trace:
        tokens = sum(n for _, n, _ in s.seqs)
        weight_bytes = params * dtype_bytes
        kv_bytes = s.kv_tokens_read * kv_per_token
        matmul_flops = 2 * (params - embed) * tokens + 2 * embed * len(s.seqs)
        attention_flops = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * s.attention_pairs
        b, f = weight_bytes + kv_bytes, matmul_flops + attention_flops
        rows.append((b, f, max(b / ceilings["copy_bandwidth_bytes_per_s"], f / ceilings["bf16_matmul_flops_per_s"])))
    return rows


def mixed_trace():
    """Two prompts (500 and 300 tokens) in one prefill step, two decode steps, then a
    64-token chunk of a third prompt continuing 1,000 cached tokens beside two decodes."""
    return [
        step([(0, 500, "prefill"), (1, 300, "prefill")], 800, 500 * 501 // 2 + 300 * 301 // 2, 0),
        step([(0, 1, "decode"), (1, 1, "decode")], 501 + 301, 501 + 301, 1),
        step([(0, 1, "decode"), (1, 1, "decode")], 502 + 302, 502 + 302, 2),
        step([(2, 64, "prefill"), (0, 1, "decode"), (1, 1, "decode")], 1064 + 503 + 303,
             64 * 1000 + 64 * 65 // 2 + 503 + 303, 3),
    ]


@pytest.mark.parametrize("dtype_bytes", [2, 4], ids=["bf16", "fp32"])
def test_ch15_bytes_and_flops_of_the_steps(dtype_bytes):
    trace = mixed_trace()
    got = speed_of_light(trace, CONFIG, PARAMS, CEILINGS, dtype_bytes)
    rows = roofline(trace, CONFIG, PARAMS, CEILINGS, dtype_bytes)
    assert got["bytes"] == pytest.approx(sum(r[0] for r in rows), rel=1e-12), (
        f"total bytes {got['bytes']:.6g}, expected {sum(r[0] for r in rows):.6g}: every step reads every weight once "
        f"(params * dtype_bytes) plus the K/V of the tokens its attention reads (kv_tokens_read * kv_bytes_per_token)")
    assert got["flops"] == pytest.approx(sum(r[1] for r in rows), rel=1e-12), (
        f"total FLOPs {got['flops']:.6g}, expected {sum(r[1] for r in rows):.6g}: 2 per body weight per token, 2 per "
        f"vocabulary-matrix weight per sampled row (one per sequence), 4 * layers * heads * head_dim per attention pair")


def test_ch15_each_step_is_bound_by_its_own_ceiling():
    # The prefill step is compute-bound, the decodes memory-bound: the floor of the whole
    # trace is the sum of each step's own max, more than the max of the two totals' times
    # and less than the sum of both times.
    trace = mixed_trace()
    rows = roofline(trace, CONFIG, PARAMS, CEILINGS, 2)
    got = speed_of_light(trace, CONFIG, PARAMS, CEILINGS, 2)
    floor = sum(r[2] for r in rows)
    assert got["floor_seconds"] == pytest.approx(floor, rel=1e-12), (
        f"floor {got['floor_seconds']:.6g} s, expected {floor:.6g} s = the sum over steps of "
        f"max(step bytes / copy bandwidth, step FLOPs / matmul rate); per step: "
        + ", ".join(f"{r[2] * 1e3:.3f} ms" for r in rows))


def test_ch15_one_decode_step_by_hand():
    # One sequence decoding its 101st token: 1e6 bf16 weights = 2 MB; K/V of 101 tokens
    # = 101 * (2 * 4 layers * 2 heads * 16 dims * 2 bytes) = 51,712 B; at 1 GB/s that is
    # 2.051712 ms. Its ~2 MFLOPs take 20 us at 100 GFLOP/s: memory-bound.
    got = speed_of_light([step([(0, 1, "decode")], 101, 101)], CONFIG, PARAMS, CEILINGS, 2)
    assert got["bytes"] == 2_000_000 + 101 * 512
    assert got["floor_seconds"] == pytest.approx(2.051712e-3, rel=1e-12)
    flops = 2 * (PARAMS - 64_000) + 2 * 64_000 + 4 * 4 * 8 * 16 * 101
    assert got["flops"] == flops


def test_ch15_on_a_real_engine_trace(tiny_qwen3):
    from minivllm import LLM, SamplingParams

    llm = LLM(model=tiny_qwen3, dtype="float32", device="cpu", record_trace=True, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=32)
    prompts = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40, 12)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    trace = llm.engine.trace
    assert len(trace) > 3
    model = llm.engine.runner.model
    params = sum(p.numel() for p in model.parameters())
    ceilings = {"copy_bandwidth_bytes_per_s": 3e8, "bf16_matmul_flops_per_s": 2e9}  # prefills compute-bound
    got = speed_of_light(trace, model.config, params, ceilings, 4)
    rows = roofline(trace, model.config, params, ceilings, 4)
    assert got["bytes"] == pytest.approx(sum(r[0] for r in rows), rel=1e-12)
    assert got["flops"] == pytest.approx(sum(r[1] for r in rows), rel=1e-12)
    assert got["floor_seconds"] == pytest.approx(sum(r[2] for r in rows), rel=1e-12)


# --- what a step's attention touches: attention_work --------------------------------------


def _batch(*seqs):
    """A scheduled batch of (tokens already computed, new tokens) per sequence."""
    return SimpleNamespace(seqs=[SimpleNamespace(num_computed_tokens=c) for c, _ in seqs],
                           num_new_tokens=[n for _, n in seqs])


def test_ch15_attention_work_of_a_decode_and_a_prompt():
    from minivllm.engine.trace import attention_work

    got = attention_work(_batch((99, 1)))
    assert got == {"kv_tokens_read": 100, "attention_pairs": 100}, (
        f"one token decoded after 99 cached ones reads 100 keys and scores 100 pairs, got {got}")
    got = attention_work(_batch((0, 4)))
    assert got == {"kv_tokens_read": 4, "attention_pairs": 10}, (
        f"a 4-token prompt from scratch is causal: 1 + 2 + 3 + 4 = 10 pairs, 4 tokens read; got {got}")
    got = attention_work(_batch((8, 3)))
    assert got == {"kv_tokens_read": 11, "attention_pairs": 3 * 8 + 6}, (
        f"a chunk of 3 after 8 cached tokens: each new token sees the 8, then 1, 2, 3 of its own; got {got}")


def test_ch15_attention_work_adds_up_over_the_batch():
    from minivllm.engine.trace import attention_work

    seqs = [(0, 5), (17, 1), (3, 2), (40, 1)]
    expected_pairs = sum(sum(c + i for i in range(1, n + 1)) for c, n in seqs)
    got = attention_work(_batch(*seqs))
    assert got == {"kv_tokens_read": sum(c + n for c, n in seqs), "attention_pairs": expected_pairs}, (
        f"the batch's counts are the sums of its sequences' (here {expected_pairs} pairs), got {got}")
    assert attention_work(_batch()) == {"kv_tokens_read": 0, "attention_pairs": 0}, "an empty batch touches nothing"
