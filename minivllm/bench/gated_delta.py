"""The gated delta rule's Triton kernels against the torch reference, at a Qwen3.5 layer's shape.

One Gated DeltaNet layer of Qwen3.5 (16 key heads, 32 value heads, key and value dims 128,
bfloat16 activations, a float32 state): prefill of whole prompts (the chunked form) and one
decode step for a batch of sequences (the recurrent form), each timed for the Triton kernels
and for the torch reference (``minivllm.ops.gated_delta``, the same math in torch ops).

Decode is memory-bound: each step reads and writes every sequence's state once, 2 x 32 x
128 x 128 x 4 bytes = 4 MiB per sequence and layer; its bytes/s are compared with the copy
bandwidth. Prefill is compute-bound at long prompts; its FLOP rate is compared with the bf16
matmul rate (the kernels multiply in tf32 from float32 tiles, so that ceiling is generous).
"""
from unittest import mock

import torch

from minivllm.bench.roofline import measure_ceilings, save_report, time_cuda
from minivllm.context import Context
from minivllm.ops import gated_delta as ops

QWEN3_5_LAYER = dict(num_k_heads=16, num_v_heads=32, dk=128, dv=128)


def _inputs(num_tokens: int, hk: int, hv: int, dk: int, dv: int, dtype=torch.bfloat16):
    mixed = torch.randn(num_tokens, 2 * hk * dk + hv * dv, device="cuda", dtype=dtype)
    q = mixed[:, : hk * dk].view(num_tokens, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(num_tokens, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(num_tokens, hv, dv)
    g = -torch.rand(num_tokens, hv, device="cuda") * 0.5  # log decays
    beta = torch.rand(num_tokens, hv, device="cuda")
    return q, k, v, g, beta


def prefill_case(lens: list[int], hk=16, hv=32, dk=128, dv=128) -> dict:
    from minivllm.kernels.gated_delta import chunk_gated_delta_varlen

    q, k, v, g, beta = _inputs(sum(lens), hk, hv, dk, dv)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    states = torch.randn(len(lens), hv, dk, dv, device="cuda")
    slots = torch.arange(len(lens), device="cuda")
    fresh = torch.zeros(len(lens), dtype=torch.long, device="cuda")
    triton_s = time_cuda(lambda: chunk_gated_delta_varlen(q, k, v, g, beta, states, slots, fresh, cu, max(lens)))
    ctx = Context(is_prefill=True, cu_seqlens_q=cu, max_seqlen_q=max(lens), state_slots=slots, has_initial_state=fresh)
    reference_s = time_cuda(lambda: _reference(q, k, v, g, beta, states, ctx), warmup=1, repeat=3)
    tokens = sum(lens)
    chunk = ops.CHUNK_SIZE
    # Per chunk and value head: the [C, C] system and its inverse applied to K and V, the
    # state read and written, and the outputs (see kernels/gated_delta.py's header).
    flops = tokens * hv * (4 * chunk * (dk + dv) + chunk * chunk + 4 * dk * dv)
    return {"prompt_lens": lens, "tokens": tokens, "triton_seconds": triton_s, "reference_seconds": reference_s,
            "speedup": reference_s / triton_s, "triton_tokens_per_s": tokens / triton_s, "flops": flops,
            "triton_flops_per_s": flops / triton_s}


def decode_case(batch: int, hk=16, hv=32, dk=128, dv=128) -> dict:
    from minivllm.kernels.gated_delta import recurrent_gated_delta_step

    q, k, v, g, beta = _inputs(batch, hk, hv, dk, dv)
    states = torch.randn(batch, hv, dk, dv, device="cuda")
    slots = torch.randperm(batch, device="cuda")
    cont = torch.ones(batch, dtype=torch.long, device="cuda")
    triton_s = time_cuda(lambda: recurrent_gated_delta_step(q, k, v, g, beta, states, slots, cont), warmup=5, repeat=50)
    ctx = Context(is_prefill=False, cu_seqlens_q=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
                  max_seqlen_q=1, state_slots=slots, has_initial_state=cont)
    reference_s = time_cuda(lambda: _reference(q, k, v, g, beta, states, ctx), warmup=3, repeat=20)
    bytes_moved = 2 * states.numel() * 4 + sum(x.numel() * x.element_size() for x in (q, k, v, v))
    return {"batch": batch, "triton_seconds": triton_s, "reference_seconds": reference_s,
            "speedup": reference_s / triton_s, "bytes": bytes_moved, "triton_bytes_per_s": bytes_moved / triton_s}


def _reference(q, k, v, g, beta, states, ctx):
    """The torch path of the same op (the dispatch would pick the kernels on a GPU)."""
    with mock.patch.object(ops, "use_triton", lambda x: False):
        return ops.gated_delta_rule_varlen(q, k, v, g, beta, states, ctx)


def main(out_dir: str = "benchmarks") -> dict:
    ceilings = measure_ceilings()
    bw, flops = ceilings["copy_bandwidth_bytes_per_s"], ceilings["bf16_matmul_flops_per_s"]
    prefill = [prefill_case(lens) for lens in ([512], [4096], [1024] * 4, [8192])]
    for case in prefill:
        case["percent_of_bf16_matmul_rate"] = 100 * case["triton_flops_per_s"] / flops
    decode = [decode_case(b) for b in (1, 16, 64, 256)]
    for case in decode:
        case["percent_of_copy_bandwidth"] = 100 * case["triton_bytes_per_s"] / bw
    report = {"ceilings": ceilings, "layer": QWEN3_5_LAYER, "chunked_prefill": prefill, "recurrent_decode": decode}
    return save_report(report, out_dir, "gated_delta.json")
