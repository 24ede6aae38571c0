"""The decode attention kernel's tiles on a float8 KV cache against a bf16 one (chapter 20).

A float8 tile of BLOCK_N keys is half the bytes of a bf16 one, so the tiles tuned for bf16
keep half as many bytes in flight: this sweeps BLOCK_N, warps and pipeline stages on both
caches at the throughput workload's decode shapes (Qwen3-0.6B's heads, 16-token blocks,
shuffled block tables) and reports each as a share of the copy bandwidth, with the largest
difference of its output from the default tiles' (a tile that computes something else is
worthless however fast it is).

    python scripts/tune_fp8_decode.py --out benchmarks/fp8_decode_tuning.json

``--profile bf16`` or ``--profile fp8``: three launches of the default tile at 256 x 1,024
and nothing else, for a profiler to read the third:

    ncu --clock-control none -k regex:_decode_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section LaunchStats --section SchedulerStats \
        python scripts/tune_fp8_decode.py --profile fp8

and the sectors each level of memory saw (asked of L1 by the tiles' asynchronous copies
(ldgsts) and by plain loads, read from L2, hitting there, read from DRAM):

    ncu --clock-control none -k regex:_decode_kernel --launch-skip 2 --launch-count 1 \
        --metrics l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,\
lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,dram__sectors_read.sum \
        python scripts/tune_fp8_decode.py --profile fp8
"""
import argparse
import itertools
import json

import torch

from minivllm.bench.roofline import measure_ceilings, time_cuda
from minivllm.kernels.paged_attention import decode_config, paged_decode_attention
from minivllm.ops.attention import value_cache_view

SHAPES = [(256, 1024), (128, 2048), (64, 512)]  # (sequences, context tokens)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16


def case(batch: int, context: int, dtype: torch.dtype, generator: torch.Generator) -> dict:
    blocks = batch * context // BLOCK_SIZE
    k = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", generator=generator)
    v = torch.randn(k.shape, device="cuda", generator=generator)
    tables = torch.randperm(blocks, device="cuda", generator=generator, dtype=torch.int32).view(batch, -1)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
    scales = {}
    if dtype == torch.float8_e4m3fn:
        scales = {"k_scale": torch.tensor([k.abs().max() / 448], device="cuda"),
                  "v_scale": torch.tensor([v.abs().max() / 448], device="cuda")}
        k, values = (k / scales["k_scale"]).to(dtype), (v / scales["v_scale"]).to(dtype)
        v = value_cache_view(torch.empty_like(values))  # a float8 cache's values' layout
        v.copy_(values)
    else:
        k, v = k.to(dtype), v.to(dtype)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return {"args": (q, k, v, tables, lens, HEAD_DIM**-0.5, context), "scales": scales,
            "bytes": 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()}


def profile(variant: str) -> None:
    """Three launches of one cache's default tile at 256 x 1,024 (a profiler reads the third)."""
    dtype = torch.bfloat16 if variant == "bf16" else torch.float8_e4m3fn
    c = case(256, 1024, dtype, torch.Generator("cuda").manual_seed(0))
    for _ in range(3):
        paged_decode_attention(*c["args"], **c["scales"])
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--profile", choices=["bf16", "fp8"], help="three launches of the default tile, for a profiler")
    args = parser.parse_args()
    if args.profile:
        profile(args.profile)
        return
    if not args.out:
        parser.error("--out is required")
    bandwidth = measure_ceilings()["copy_bandwidth_bytes_per_s"]
    generator = torch.Generator("cuda").manual_seed(0)
    configs = [{"BLOCK_N": n, "num_warps": w, "num_stages": s}
               for n, w, s in itertools.product((64, 128, 256), (4, 8), (2, 3, 4))]
    rows = []
    for (batch, context), dtype in itertools.product(SHAPES, (torch.bfloat16, torch.float8_e4m3fn)):
        c = case(batch, context, dtype, generator)
        default = paged_decode_attention(*c["args"], **c["scales"])
        for config in [None, *configs]:
            try:
                out = paged_decode_attention(*c["args"], config=config, **c["scales"])
                seconds = time_cuda(lambda: paged_decode_attention(*c["args"], config=config, **c["scales"]),
                                    warmup=3, repeat=20)
            except Exception as e:  # a tile that does not fit in shared memory: recorded, not timed
                rows.append({"batch": batch, "context": context, "kv": str(dtype), "config": config,
                             "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            row = {"batch": batch, "context": context, "kv": str(dtype).removeprefix("torch."),
                   "config": config or {"default": decode_config(HEAD_DIM, c["args"][1].element_size())},
                   "seconds": seconds, "percent_of_copy_bandwidth": 100 * c["bytes"] / seconds / bandwidth,
                   "max_diff_from_default": (out.float() - default.float()).abs().max().item()}
            rows.append(row)
            print(f"{batch:4d} x {context:5d} {row['kv']:14s} {json.dumps(row['config']):60s} "
                  f"{seconds * 1e6:8.1f} us {row['percent_of_copy_bandwidth']:5.1f}%  diff {row['max_diff_from_default']:.1e}",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump({"copy_bandwidth_bytes_per_s": bandwidth, "device": torch.cuda.get_device_name(), "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
