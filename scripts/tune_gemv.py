"""Sweep kernels.gemv's block shapes over the decode linears of Qwen3-0.6B on a GPU, with
and without Programmatic Dependent Launch, and the gate/up product ending in SwiGLU against
the two kernels it replaces. The defaults in ``gemv_config`` and ``gated_config`` for two
rows and more come from this sweep on an H200; the one-row default (a program's whole row of
W as one tile) from the decode graph as a whole (``scripts/ab_decode_graph.py``): in a chain
of gemvs each follows another gemv, not the step's norms, RoPE and attention, whose ends a
tile loaded before the wait for the kernel before overlaps.

Each timing is a chain of one call per layer (28), each on its own matrix, captured in one
CUDA graph: as in a decode step, the weights come from HBM (one matrix timed over and over
would sit in the 50 MB L2), and each kernel follows another, which is where PDL acts.

    python scripts/tune_gemv.py --out benchmarks/gemv_tuning.json   # needs a CUDA GPU
"""
import argparse
import itertools
import json
import os

import torch

from minivllm.bench.kernels import DECODE_LINEARS
from minivllm.bench.roofline import time_cuda_graph
from minivllm.kernels.elementwise import silu_and_mul
from minivllm.kernels.gemv import gated_config, gemv, gemv_config, gemv_silu_and_mul

LAYERS = 28


def configs(rows: int, gated: bool = False) -> list[dict]:
    """The shapes swept: the sum-of-products path (DOT False, up to 8 rows) may take column
    blocks below 16; the tensor-core path (from 2 rows) takes 16 and more."""
    out = []
    if rows == 1:
        block_ns = (4, 8, 16) if gated else (4, 8, 16, 32)
        out += [{"DOT": False, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
                for bn, bk, w, s in itertools.product(block_ns, (256, 512, 1024), (4, 8), (2, 3))]
    elif rows <= 8:  # both paths, the sum path's K steps shorter (its products are rows x wider)
        out += [{"DOT": False, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
                for bn, bk, w, s in itertools.product((4, 8), (256, 512, 1024), (4, 8), (2, 3))]
    if rows > 1:
        block_ns = (16, 32) if gated else (16, 32, 64)
        out += [{"DOT": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
                for bn, bk, w, s in itertools.product(block_ns, (256, 512) if rows <= 8 else (256, 512, 1024),
                                                      (4, 8) if rows > 8 else (4,), (2, 3) if rows > 8 else (3,))]
    return out


def chain_seconds(fn, weights, x) -> float:
    """Seconds per call of fn(x, w) over a chain of one call per matrix."""
    return time_cuda_graph(lambda: [fn(x, w) for w in weights], calls=1, repeat=10) / len(weights)


def sweep(fn, weights, x, configs) -> list[tuple[float, dict]]:
    results = []
    for cfg in configs:
        try:
            results.append((chain_seconds(lambda a, w: fn(a, w, **cfg), weights, x), cfg))
        except Exception as e:  # a config that does not fit in shared memory: report and go on
            print(f"    skip {cfg}: {type(e).__name__}")
    return sorted(results, key=lambda r: r[0])


def main(out: str | None, rows_list=(1, 8)):
    report = {"device": torch.cuda.get_device_name(), "layers": LAYERS, "linears": [], "gated": []}
    for rows in rows_list:
        for name, (n, k) in DECODE_LINEARS.items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            gbytes = n * k * 2 / 1e9
            entry = {"linear": name, "rows": rows, "n": n, "k": k, "bytes": n * k * 2}
            for pdl in ("0", "1"):  # the defaults both ways; the sweep with PDL, as the engine runs
                os.environ["MINIVLLM_PDL"] = pdl
                t_default = chain_seconds(gemv, weights, x)
                entry[f"pdl{pdl}"] = {"default": gemv_config(n, k, rows), "default_seconds": t_default}
                print(f"rows={rows} {name:13s} PDL={pdl}: default {t_default*1e6:6.2f} us ({gbytes/t_default:5.0f} GB/s)")
            best = sweep(gemv, weights, x, configs(rows))
            entry["pdl1"]["best"] = [{"seconds": t, **cfg} for t, cfg in best[:3]]
            print(f"      best {best[0][0]*1e6:6.2f} us ({gbytes/best[0][0]:5.0f} GB/s) {best[0][1]}")
            entry["torch_seconds"] = chain_seconds(torch.nn.functional.linear, weights, x)
            report["linears"].append(entry)
            if name == "gate_up_proj":
                half = n // 2
                gated = {"rows": rows, "n": half, "k": k}
                for pdl in ("0", "1"):
                    os.environ["MINIVLLM_PDL"] = pdl
                    unfused = chain_seconds(lambda a, w: silu_and_mul(gemv(a, w)), weights, x)
                    fused = chain_seconds(gemv_silu_and_mul, weights, x)
                    gated[f"pdl{pdl}"] = {"unfused_seconds": unfused, "default": gated_config(half, k, rows),
                                          "default_seconds": fused}
                    print(f"rows={rows} gate_up+SiLU PDL={pdl}: gemv + silu_and_mul {unfused*1e6:6.2f} us, "
                          f"fused default {fused*1e6:6.2f} us")
                best = sweep(gemv_silu_and_mul, weights, x, configs(rows, gated=True))
                gated["pdl1"]["best"] = [{"seconds": t, **cfg} for t, cfg in best[:3]]
                print(f"      best {best[0][0]*1e6:6.2f} us {best[0][1]}")
                report["gated"].append(gated)
            del weights
    os.environ.pop("MINIVLLM_PDL", None)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the sweep as JSON here")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    main(args.out, tuple(args.rows))
