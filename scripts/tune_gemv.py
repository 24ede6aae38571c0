"""Sweep kernels.gemv's block shapes over the decode linears of Qwen3-0.6B on a GPU and
print the best per matrix, against torch's GEMM. The defaults in ``gemv_config`` come from
this sweep on an H200.

    python scripts/tune_gemv.py      # needs a CUDA GPU
"""
import itertools

import torch

from minivllm.bench.kernels import DECODE_LINEARS
from minivllm.bench.roofline import time_cuda_graph
from minivllm.kernels.gemv import gemv, gemv_config


def main():
    for rows in (1, 8):
        for name, (n, k) in DECODE_LINEARS.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            gbytes = w.numel() * 2 / 1e9
            results = []
            for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4)):
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
                try:
                    t = time_cuda_graph(lambda: gemv(x, w, **cfg), repeat=5)
                except Exception as e:  # a config that does not fit in shared memory: report and go on
                    print(f"  skip {cfg}: {type(e).__name__}")
                    continue
                results.append((t, cfg))
            results.sort(key=lambda r: r[0])
            t_default = time_cuda_graph(lambda: gemv(x, w))
            t_torch = time_cuda_graph(lambda: torch.nn.functional.linear(x, w))
            print(f"rows={rows} {name:13s} N={n:6d} K={k:5d}: torch {t_torch*1e6:7.1f} us ({gbytes/t_torch:5.0f} GB/s), "
                  f"default {gemv_config(n, k)} {t_default*1e6:7.1f} us ({gbytes/t_default:5.0f} GB/s)")
            for t, cfg in results[:3]:
                print(f"      best {t*1e6:7.1f} us ({gbytes/t:5.0f} GB/s) {cfg}")


if __name__ == "__main__":
    main()
