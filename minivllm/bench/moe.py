"""The MoE layer and a MoE model through the engine: reference loop against fused kernels.

Shapes: Qwen3-30B-A3B's layers (hidden 2048, 128 experts, top-8, expert width 768, 32
query heads / 4 key-value heads of 128) with 4 layers instead of 48, random weights,
bfloat16 (speed does not depend on the weights' values).

1. One MoE block (router + experts) at a few token counts, both paths, with its floor:
   it must read the weights of every expert some token chose (3 * 768 * 2048 each) and do
   2 * 3 * 768 * 2048 FLOPs per (token, expert) pair; floor = max(bytes / copy bandwidth,
   FLOPs / matmul rate), both measured in this run.
2. Offline throughput of the 4-layer model: the reference loop (it syncs with the host
   once per expert, so it runs eagerly), the fused kernels eagerly, and the fused kernels
   with CUDA graphs.

Writes ``benchmarks/moe.json``.
"""
import os
from unittest import mock

import torch

from minivllm.bench.roofline import measure_ceilings, save_report, time_cuda

QWEN3_30B_A3B_4_LAYERS = dict(  # Qwen3-30B-A3B's shapes, 4 of its 48 layers
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
)
TOKEN_COUNTS = (1, 8, 64, 256, 1024, 4096)


def with_backend(backend: str, fn):
    """Run fn with MINIVLLM_MOE_BACKEND set to ``backend``; the environment is restored afterwards."""
    with mock.patch.dict(os.environ, MINIVLLM_MOE_BACKEND=backend):
        return fn()


def layer_case(block, tokens: int, ceilings: dict, shapes: dict) -> dict:
    from minivllm.layers.moe import route

    hidden, inter = shapes["hidden_size"], shapes["moe_intermediate_size"]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        _, ids = route(block.gate(x), block.top_k, block.renormalize)
        experts_hit = int(ids.unique().numel())
        seconds = {b: with_backend(b, lambda: time_cuda(lambda: block(x), warmup=3, repeat=10))
                   for b in ("reference", "fused")}
    expert_bytes = 3 * inter * hidden * 2
    bytes_moved = experts_hit * expert_bytes + block.gate.weight.numel() * 2 + 2 * x.numel() * 2
    flops = 2 * tokens * block.top_k * 3 * inter * hidden
    floor = max(bytes_moved / ceilings["copy_bandwidth_bytes_per_s"], flops / ceilings["bf16_matmul_flops_per_s"])
    return {
        "tokens": tokens, "experts_hit": experts_hit,
        "reference_seconds": seconds["reference"], "fused_seconds": seconds["fused"],
        "speedup": seconds["reference"] / seconds["fused"],
        "floor_seconds": floor, "fused_percent_of_floor": 100 * floor / seconds["fused"],
    }


def layer_benchmark(ceilings: dict, shapes: dict = QWEN3_30B_A3B_4_LAYERS) -> list[dict]:
    from minivllm.layers.moe import SparseMoeBlock

    torch.manual_seed(0)
    hidden, inter = shapes["hidden_size"], shapes["moe_intermediate_size"]
    with torch.device("cuda"):
        block = SparseMoeBlock(hidden, shapes["num_experts"], shapes["num_experts_per_tok"], inter,
                               shapes["norm_topk_prob"]).to(torch.bfloat16)
    with torch.no_grad():
        for p, fan_in in ((block.gate.weight, hidden), (block.experts.gate_up_proj, hidden),
                          (block.experts.down_proj, inter)):
            p.normal_(0, fan_in**-0.5)
    cases = [layer_case(block, n, ceilings, shapes) for n in TOKEN_COUNTS]
    del block
    torch.cuda.empty_cache()
    return cases


def engine_benchmark(num_requests: int = 128, max_len: int = 512) -> dict:
    from minivllm.bench.throughput import make_workload, model_checkpoint, run_minivllm

    path = model_checkpoint("qwen3-30b-a3b-4l-random", QWEN3_30B_A3B_4_LAYERS, family="qwen3_moe")
    prompts, output_lens = make_workload(num_requests, max_len=max_len)
    runs = {}
    for name, backend, eager in (("reference_eager", "reference", True), ("fused_eager", "fused", True),
                                 ("fused_cuda_graphs", "fused", False)):
        result = with_backend(backend, lambda: run_minivllm(path, prompts, output_lens, enforce_eager=eager, second_run=False))
        for key in ("_trace", "_params", "_config"):
            result.pop(key)
        runs[name] = result
    return {
        "workload": {"requests": num_requests, "prompt_len": [100, max_len], "output_len": [100, max_len],
                     "temperature": 0.6, "ignore_eos": True,
                     "total_prompt_tokens": sum(map(len, prompts)), "total_output_tokens": sum(output_lens)},
        "runs": runs,
        "fused_speedup_eager": runs["fused_eager"]["output_tokens_per_s"] / runs["reference_eager"]["output_tokens_per_s"],
        "fused_speedup_with_graphs": runs["fused_cuda_graphs"]["output_tokens_per_s"]
        / runs["reference_eager"]["output_tokens_per_s"],
    }


def main(out_dir: str = "benchmarks") -> dict:
    ceilings = measure_ceilings()
    report = {
        "model": "random weights, Qwen3-30B-A3B layer shapes, 4 layers, bfloat16",
        "shapes": QWEN3_30B_A3B_4_LAYERS,
        "ceilings": ceilings,
        "moe_layer": layer_benchmark(ceilings),
        "engine": engine_benchmark(),
        "torch": torch.__version__,
    }
    return save_report(report, out_dir, "moe.json")
