"""Each Triton kernel against its torch reference and its roofline, at real shapes."""
import torch

from minivllm.bench.roofline import measure_ceilings, save_report, time_cuda, time_cuda_graph


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


# The linear layers of one Qwen3-0.6B decoder layer (N, K), and its LM head.
DECODE_LINEARS = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
                  "down_proj": (1024, 3072), "lm_head": (151936, 1024)}


def gemv_case(name: str, rows: int, n: int, k: int, dtype=torch.bfloat16):
    """One decode linear at a small batch: kernels.gemv against torch's GEMM (cuBLAS)."""
    from minivllm.kernels.gemv import gemv

    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    bytes_moved = w.numel() * w.element_size()
    t_gemv = time_cuda_graph(lambda: gemv(x, w))
    t_torch = time_cuda_graph(lambda: torch.nn.functional.linear(x, w))
    return {"linear": name, "rows": rows, "n": n, "k": k, "bytes": bytes_moved,
            "gemv_seconds": t_gemv, "torch_seconds": t_torch}


def main(out_dir: str = "benchmarks") -> dict:
    ceilings = measure_ceilings()
    bw = ceilings["copy_bandwidth_bytes_per_s"]
    cases = [paged_decode_case(b, c) for b, c in [(64, 2048), (1, 8192), (8, 4096), (256, 1024)]]
    for case in cases:
        case["percent_of_copy_bandwidth"] = 100 * case["bytes_per_s"] / bw
    linears = [gemv_case(name, rows, n, k) for rows in (1, 8) for name, (n, k) in DECODE_LINEARS.items()]
    for case in linears:
        for who in ("gemv", "torch"):
            case[f"{who}_percent_of_copy_bandwidth"] = 100 * case["bytes"] / case[f"{who}_seconds"] / bw
    report = {"ceilings": ceilings, "paged_decode_attention": cases, "decode_linears": linears}
    return save_report(report, out_dir, "kernels.json")
