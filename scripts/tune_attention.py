"""Sweep the paged attention kernels' tile shapes on a GPU, check each against a torch
reference, and print the best against the ceilings measured in the same run: prefill
against the matmul rate, decode against the copy bandwidth. The defaults in
``kernels.paged_attention.prefill_config`` and ``decode_config`` come from this sweep on an
H200.

    python scripts/tune_attention.py [--baseline OLD_paged_attention.py] [--out FILE]

Workloads, Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128, bf16, blocks
of 16 tokens): 8 causal prompts of 1,000 tokens; 8 chunks of 512 tokens after 3,000 cached
tokens each (chunked prefill over a cached prefix); 64 prompts of 600 tokens.
FLOPs count only the visible (query, key) pairs: 4 * head_dim * heads per pair.
Decode: 256 sequences with contexts uniform in [100, 2048] (the throughput workload's
decode steps), and 64 sequences of 2,048 (the chapter 15 kernel benchmark's case), sized
for a 4,096-token max_model_len as under the engine's CUDA graphs; bytes are the K and V
read. ``--baseline`` times another version of the kernel module (e.g. an older commit's
``minivllm/kernels/paged_attention.py``) on the same inputs.
"""
import argparse
import importlib.util
import itertools
import json

import torch

from minivllm.bench.roofline import measure_ceilings, time_cuda
from minivllm.kernels import paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
WORKLOADS = {"8x1000 causal": ([1000] * 8, [1000] * 8),
             "8x512 after 3000 cached": ([3512] * 8, [512] * 8),
             "64x600 causal": ([600] * 64, [600] * 64)}


def make_inputs(lens, q_lens, generator):
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks) + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                          generator=generator)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device="cuda", generator=generator)  # blocks scattered, as in a real pool
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"), cu


def reference(q, k_cache, v_cache, tables, lens, q_lens):
    """Causal attention per sequence in float32 on gathered keys and values."""
    out, start = [], 0
    for b, (n, qn) in enumerate(zip(lens, q_lens)):
        rows = tables[b, : -(-n // BLOCK_SIZE)].long()
        k = k_cache[rows].reshape(-1, KV_HEADS, HEAD_DIM)[:n].float().repeat_interleave(HEADS // KV_HEADS, 1)
        v = v_cache[rows].reshape(-1, KV_HEADS, HEAD_DIM)[:n].float().repeat_interleave(HEADS // KV_HEADS, 1)
        qq = q[start : start + qn].float()
        s = torch.einsum("qhd,khd->hqk", qq, k) * HEAD_DIM**-0.5
        visible = torch.arange(n, device="cuda")[None, :] <= (n - qn + torch.arange(qn, device="cuda"))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += qn
    return torch.cat(out)


def pairs(lens, q_lens):
    return sum(qn * (n - qn) + qn * (qn + 1) // 2 for n, qn in zip(lens, q_lens))


def run(module, inputs, max_q, config=None):
    q, k_cache, v_cache, tables, lens, cu = inputs
    kwargs = {"config": config} if config else {}
    return module.paged_prefill_attention(q, k_cache, v_cache, tables, lens, cu, max_q, HEAD_DIM**-0.5, **kwargs)


DECODE_WORKLOADS = {"256 x [100, 2048]": torch.Generator().manual_seed(1), "64 x 2048": None}


def sweep_decode(baseline, bandwidth):
    from minivllm.bench.roofline import time_cuda_graph

    generator = torch.Generator(device="cuda").manual_seed(1)
    cases = {}
    for name, lens_gen in DECODE_WORKLOADS.items():
        lens = torch.randint(100, 2049, (256,), generator=lens_gen).tolist() if lens_gen else [2048] * 64
        q, k_cache, v_cache, tables, lens_t, _ = make_inputs(lens, [1] * len(lens), generator)
        ref = reference(q, k_cache, v_cache, tables, lens, [1] * len(lens))
        cases[name] = (q, k_cache, v_cache, tables, lens_t, ref, 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2)

    def measure(module, config=None):
        row = {}
        for name, (q, k_cache, v_cache, tables, lens_t, ref, nbytes) in cases.items():
            kwargs = {"config": config} if config else {}
            fn = lambda: module.paged_decode_attention(q, k_cache, v_cache, tables, lens_t, HEAD_DIM**-0.5, 4096, **kwargs)
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"decode {name}: relative error {err:.2e}")
            t = time_cuda_graph(fn, calls=10, repeat=10)
            row[name] = {"seconds": t, "percent_of_copy_bandwidth": 100 * nbytes / t / bandwidth, "relative_error": err}
        return row

    result = {"default": {"config": paged_attention.decode_config(HEAD_DIM), **measure(paged_attention)}}
    if baseline is not None:
        result["baseline"] = measure(baseline)
    sweep = []
    for bn, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8), (2, 3, 4)):
        config = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        try:
            sweep.append({"config": config, **measure(paged_attention, config)})
        except AssertionError:
            raise
        except Exception as e:  # a tile that does not fit: say so, go on
            print(f"skip decode {config}: {type(e).__name__}: {str(e)[:80]}")
    sweep.sort(key=lambda r: r["256 x [100, 2048]"]["seconds"])
    result["sweep"] = sweep
    print("decode, % of copy bandwidth per workload (" + ", ".join(cases) + ")")
    for label, row in [("baseline", result.get("baseline")), ("default", result["default"])] + \
            [(str(r["config"]), r) for r in sweep[:6]]:
        if row:
            print(f"{label:70s} " + "  ".join(f"{row[w]['percent_of_copy_bandwidth']:5.1f}%" for w in cases))
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="another paged_attention.py to time on the same inputs")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    rate = ceilings["bf16_matmul_flops_per_s"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    data = {name: make_inputs(lens, q_lens, generator) for name, (lens, q_lens) in WORKLOADS.items()}
    refs = {name: reference(*data[name][:4], *WORKLOADS[name]) for name in WORKLOADS}
    flops = {name: 4 * HEAD_DIM * HEADS * pairs(*WORKLOADS[name]) for name in WORKLOADS}

    def measure(module, config=None):
        row = {}
        for name, (lens, q_lens) in WORKLOADS.items():
            out = run(module, data[name], max(q_lens), config)
            err = ((out.float() - refs[name]).norm() / refs[name].norm()).item()
            if not err < 1e-2:  # bf16 operands: about 3e-3
                raise AssertionError(f"{name}: relative error {err:.2e}")
            t = time_cuda(lambda: run(module, data[name], max(q_lens), config), warmup=3, repeat=20)
            row[name] = {"seconds": t, "tflops": flops[name] / t / 1e12, "percent_of_matmul": 100 * flops[name] / t / rate,
                         "relative_error": err}
        return row

    report = {"ceilings": ceilings, "workloads": {k: {"lens": v[0][:1], "q_lens": v[1][:1], "seqs": len(v[0])}
                                                  for k, v in WORKLOADS.items()}}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_attention", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
        report["baseline"] = measure(baseline)
    report["default"] = {"config": paged_attention.prefill_config(HEAD_DIM, HEADS // KV_HEADS),
                         **measure(paged_attention)}
    sweep = []
    for bm, bn, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        try:
            sweep.append({"config": config, **measure(paged_attention, config)})
        except AssertionError:
            raise
        except Exception as e:  # a tile that does not fit in shared memory or registers: say so, go on
            print(f"skip {config}: {type(e).__name__}: {str(e)[:80]}")
    report["decode"] = sweep_decode(baseline if args.baseline else None, ceilings["copy_bandwidth_bytes_per_s"])
    first = list(WORKLOADS)[0]
    sweep.sort(key=lambda r: r[first]["seconds"])
    report["sweep"] = sweep
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"matmul rate {rate / 1e12:.0f} TFLOP/s; % of it per workload ({', '.join(WORKLOADS)})")
    for label, row in [("baseline", report.get("baseline")), ("default", report["default"])] + \
            [(str(r["config"]), r) for r in sweep[:8]]:
        if row:
            print(f"{label:70s} " + "  ".join(f"{row[w]['percent_of_matmul']:5.1f}%" for w in WORKLOADS))


if __name__ == "__main__":
    main()
