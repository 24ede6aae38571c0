#!/usr/bin/env python
"""The decode step's matmuls at 32-256 rows: cuBLAS, cuBLASLt and Triton tiles, against the roofline.

At batch 256 a decode step's linear layers are matrices of Qwen3-0.6B's shapes times 256
rows: about as many FLOPs per weight byte as the H200's ridge point, so neither the weights'
bytes nor the FLOPs alone set their time. The throughput profiles put them at about three
times their floor (benchmarks/README.md, "where a batch-256 decode step's time goes"). This
script times each shape and row count:

- ``cublas``: ``F.linear`` as the engine calls it (torch's default BLAS library);
- ``cublaslt``: the same with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``triton``: a plain tiled matmul (``_matmul_kernel`` below, its first K step peeled off)
  at each tile of ``TILES``, checked against torch first; the best tile is reported (the
  sweep in ``benchmarks/h100/decode_gemm_tiles.json`` ran the kernel before the peel);
- ``triton_pdl``: the best tile again, launched with Programmatic Dependent Launch (Hopper):
  each program loads its first weight tile, then waits for the kernel before
  (``kernels.pdl``), so a product's launch and first loads overlap the one before it, as the
  decode gemv's do (cuBLAS cannot).

Each figure is a CUDA graph of ``CALLS`` products replayed, divided by ``CALLS``: one
product after another, each with its own copy of the weights (more bytes than L2 holds, as
in a decode step, where every layer's weights come from HBM); the median of ten replays
(the sweep in ``benchmarks/h100/decode_gemm_tiles.json`` took the best of five). The roofline is the larger of
the weights' bytes at the measured copy bandwidth and the FLOPs at the measured bf16 matmul
rate. ``--budget-s`` stops the sweep (what was measured is still written).

    python scripts/tune_decode_gemm.py [--rows 32 64 128 256] [--budget-s 150] [--out FILE]
"""
import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.bench.roofline import measure_ceilings, time_cuda_graph
from minivllm.kernels.pdl import pdl_options, wait_for_previous

# Qwen3-0.6B's decode linears: (name, N, K) of W [N, K].
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [(64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3),
         (128, 64, 64, 4, 4), (128, 64, 128, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
         (64, 32, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 256, 4, 3), (128, 32, 128, 4, 4),
         (32, 128, 128, 4, 4), (128, 256, 64, 8, 3),
         # Long K steps: few loop trips, every load in flight at once (the decode gemv's way)
         (32, 32, 512, 4, 2), (64, 32, 512, 4, 2), (32, 64, 512, 4, 2), (32, 32, 1024, 4, 1),
         (64, 32, 1024, 8, 1), (16, 64, 512, 4, 2)]
CALLS = 16


@triton.jit
def _matmul_kernel(a_ptr, w_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """C [M, N] = A [M, K] @ W [N, K]^T, one [BLOCK_M, BLOCK_N] tile a program, grouped along M;
    with USE_PDL the first weight tile is loaded before waiting for the kernel before."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    # The first K step peeled off: its weight tile is loaded before the wait (the weights
    # never depend on the kernel before), its activations after.
    w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
    wait_for_previous(USE_PDL)
    a = tl.load(a_ptr + m[:, None] * stride_am + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
    acc = tl.dot(a, tl.trans(w))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + k
        a = tl.load(a_ptr + m[:, None] * stride_am + kk[None, :], mask=(m[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    tl.store(c_ptr + m[:, None] * stride_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def triton_linear(a: torch.Tensor, w: torch.Tensor, tile: tuple, pdl: bool = False) -> torch.Tensor:
    bm, bn, bk, warps, stages = tile
    m, k = a.shape
    n = w.shape[0]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](a, w, c, m, n, k, a.stride(0), w.stride(0), c.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         GROUP_M=8, num_warps=warps, num_stages=stages,
                         **(pdl_options(a) if pdl else {"USE_PDL": False}))
    return c


def per_call_us(fn, xs, ws) -> float:
    """Microseconds a product: CALLS products (fn(x, w), each pair once) in one CUDA graph,
    replayed (``bench.roofline.time_cuda_graph``)."""
    pairs = itertools.cycle(zip(xs, ws))
    return time_cuda_graph(lambda: fn(*next(pairs)), calls=len(xs)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--budget-s", type=float, default=150)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    deadline = time.perf_counter() + args.budget_s
    ceilings = measure_ceilings()
    bandwidth, rate = ceilings["copy_bandwidth_bytes_per_s"], ceilings["bf16_matmul_flops_per_s"]
    report = {"device": torch.cuda.get_device_name(), "copy_bandwidth_bytes_per_s": bandwidth,
              "bf16_matmul_flops_per_s": rate, "calls_per_graph": CALLS, "results": []}
    torch.manual_seed(0)
    for name, n, k in SHAPES:
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _ in range(CALLS)]
        for m in args.rows:
            if time.perf_counter() > deadline:
                break
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(CALLS)]
            floor_us = max(n * k * 2 / bandwidth, 2 * m * n * k / rate) * 1e6
            row = {"shape": name, "n": n, "k": k, "rows": m, "roofline_us": floor_us,
                   "cublas_us": per_call_us(F.linear, xs, ws)}
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["cublaslt_us"] = per_call_us(F.linear, xs, ws)
            torch.backends.cuda.preferred_blas_library("cublas")
            tiles = {}
            ref = F.linear(xs[0].float(), ws[0].float())
            for tile in TILES:
                if time.perf_counter() > deadline:
                    break
                try:
                    out = triton_linear(xs[0], ws[0], tile)
                except Exception as e:  # a tile this GPU cannot hold (shared memory): skipped, and said
                    tiles[str(tile)] = f"failed: {type(e).__name__}"
                    continue
                if not torch.allclose(out.float(), ref, atol=3e-2, rtol=3e-2):
                    tiles[str(tile)] = "wrong result"
                    continue
                tiles[str(tile)] = per_call_us(lambda x, w, t=tile: triton_linear(x, w, t), xs, ws)
            timed = {t: us for t, us in tiles.items() if isinstance(us, float)}
            best = min(timed, key=timed.get) if timed else None
            row.update(triton_tiles_us=tiles, triton_best=best, triton_best_us=timed.get(best))
            if best is not None:
                tile = tuple(int(v) for v in best.strip("()").split(","))
                assert torch.allclose(triton_linear(xs[0], ws[0], tile, pdl=True).float(), ref, atol=3e-2, rtol=3e-2)
                row["triton_pdl_us"] = per_call_us(lambda x, w, t=tile: triton_linear(x, w, t, pdl=True), xs, ws)
            report["results"].append(row)
            print(f"{name:8s} rows {m:4d}: roofline {floor_us:6.2f} us, cublas {row['cublas_us']:6.2f}, "
                  f"cublaslt {row['cublaslt_us']:6.2f}, triton best {row['triton_best_us'] or float('nan'):6.2f} {best}, "
                  f"with PDL {row.get('triton_pdl_us', float('nan')):6.2f}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
