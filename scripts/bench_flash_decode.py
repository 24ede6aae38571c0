#!/usr/bin/env python
"""Chapter 09's comparison: the readable two-stage decode kernel (kernels/flash_decode.py)
against the engine's tuned one (kernels/paged_attention.py), on one GPU.

Qwen3-0.6B's attention shape (16 query heads, 8 K/V heads, head_dim 128, blocks of 16
tokens, bfloat16), each sequence's blocks scattered through the pool. Each kernel is first
checked against the other, then timed as calls replayed from one CUDA graph (the launch's
host work left out, as in the engine's decode graphs), and its bandwidth given as a share
of the copy bandwidth measured in the same run: the two-stage kernel with one split and
with the tuned kernel's number of splits, and the tuned kernel.

    python scripts/bench_flash_decode.py [--out benchmarks]
"""
import argparse

import torch

from minivllm.bench.roofline import measure_ceilings, save_report, time_cuda_graph
from minivllm.kernels.flash_decode import flash_decode
from minivllm.kernels.paged_attention import decode_num_splits, paged_decode_attention, sm_count

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
WORKLOADS = {"1 x 8,192": [8192], "8 x 4,096": [4096] * 8, "64 x 2,048": [2048] * 64,
             "64 x [100, 2,048]": None, "256 x 1,024": [1024] * 256}


def case(lens: list[int], bandwidth: float) -> dict:
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    k_cache = torch.randn(sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)
    tables = torch.zeros(len(lens), max(blocks), device="cuda", dtype=torch.int32)
    start = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = pool[start : start + b]
        start += b
    context_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5
    splits = decode_num_splits(len(lens), KV_HEADS, max(lens), sm_count(q))
    kernels = {
        "two-stage, 1 split": lambda: flash_decode(q, k_cache, v_cache, tables, context_lens, scale, 1),
        f"two-stage, {splits} splits": lambda: flash_decode(q, k_cache, v_cache, tables, context_lens, scale, splits),
        "tuned": lambda: paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale, max(lens)),
    }
    expected = kernels["tuned"]().float()
    moved = 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2
    row = {"sequences": len(lens), "keys": sum(lens), "bytes": moved, "splits": splits}
    for name, fn in kernels.items():
        torch.testing.assert_close(fn().float(), expected, atol=2e-2, rtol=2e-2)
        seconds = time_cuda_graph(fn)
        row[name] = {"seconds": seconds, "percent_of_copy_bandwidth": 100 * moved / seconds / bandwidth}
    return row


def main(out_dir: str) -> dict:
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    workloads = {}
    for name, lens in WORKLOADS.items():
        lens = lens or torch.randint(100, 2049, (64,)).tolist()
        workloads[name] = case(lens, ceilings["copy_bandwidth_bytes_per_s"])
        print(name, {k: f"{v['percent_of_copy_bandwidth']:.1f}%" for k, v in workloads[name].items()
                     if isinstance(v, dict)}, flush=True)
    report = {"ceilings": ceilings, "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                              "block_size": BLOCK_SIZE, "dtype": "bfloat16"}, "workloads": workloads}
    return save_report(report, out_dir, "flash_decode.json")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks", help="folder of the JSON report")
    main(parser.parse_args().out)
