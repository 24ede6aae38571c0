"""Each Triton kernel against its torch reference and its roofline, at real shapes."""
import json
from pathlib import Path

import torch

from minivllm.bench.roofline import measure_ceilings, time_cuda


def paged_decode_case(batch: int, context: int, heads=16, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16):
    from minivllm.kernels.paged_attention import paged_decode_attention

    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dtype)
    fn = lambda: paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5, context)  # noqa: E731
    t = time_cuda(fn, warmup=5, repeat=50)
    bytes_moved = 2 * k_cache.numel() * k_cache.element_size() + 2 * q.numel() * q.element_size()
    return {"batch": batch, "context": context, "seconds": t, "bytes": bytes_moved, "bytes_per_s": bytes_moved / t}


def main(out_dir: str = "benchmarks") -> dict:
    ceilings = measure_ceilings()
    bw = ceilings["copy_bandwidth_bytes_per_s"]
    cases = [paged_decode_case(b, c) for b, c in [(64, 2048), (1, 8192), (8, 4096), (256, 1024)]]
    for case in cases:
        case["percent_of_copy_bandwidth"] = 100 * case["bytes_per_s"] / bw
    report = {"ceilings": ceilings, "paged_decode_attention": cases}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "kernels.json").write_text(json.dumps(report, indent=2))
    return report
