"""Where the throughput workload's time goes on the GPU, over the whole run.

Runs ``minivllm bench throughput``'s workload (nano-vllm's bench.py draw, fresh prompts) once
under torch.profiler, kernels only, on an engine built as the benchmark builds it, and prints:
  - the GPU's busy time (the union of kernel intervals) against the run's wall time;
  - kernel time by kernel name, the largest first;
  - the GPU's idle time, in gaps between kernels, by the size of the gap and by the kernel
    that ended it (the first kernel after an idle gap shows which step, or which part of a
    step, the GPU was waiting for).

    python scripts/profile_throughput.py [--top 20] [--out profile.json]    # needs a CUDA GPU
"""
import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench.throughput import WARMUP_PROMPT, fresh_prompts, make_workload, model_checkpoint

GAP_BINS = [(0, 5e3, "< 5 us"), (5e3, 20e3, "5-20 us"), (20e3, 100e3, "20-100 us"), (100e3, 1e6, "0.1-1 ms"),
            (1e6, float("inf"), "> 1 ms")]


def short(name: str) -> str:
    """A kernel's name without its template arguments and launch details."""
    return name.split("<")[0].split("(")[0][:70]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", help="write the tables as JSON here too")
    args = parser.parse_args()
    prompts, output_lens = make_workload()
    llm = LLM(str(model_checkpoint()), dtype="bfloat16", max_model_len=4096)
    llm.generate(WARMUP_PROMPT, SamplingParams(), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(fresh_prompts(prompts, seed=3), params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = sorted((e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                     if e.device_type().name == "CUDA" and e.name() and not e.name().startswith("Memcpy"))
    by_name = defaultdict(lambda: [0, 0.0])
    gaps_by_next = defaultdict(lambda: [0, 0.0])
    gaps_by_size = {label: [0, 0.0] for *_, label in GAP_BINS}
    busy, end = 0, kernels[0][0]
    for s0, s1, name in kernels:
        entry = by_name[short(name)]
        entry[0] += 1
        entry[1] += (s1 - s0) / 1e9
        if s0 > end:  # an idle gap, ended by this kernel
            gap = s0 - end
            gaps_by_next[short(name)][0] += 1
            gaps_by_next[short(name)][1] += gap / 1e9
            for lo, hi, label in GAP_BINS:
                if lo <= gap < hi:
                    gaps_by_size[label][0] += 1
                    gaps_by_size[label][1] += gap / 1e9
        if s1 > end:
            busy += s1 - max(s0, end)
            end = s1
    span = (end - kernels[0][0]) / 1e9
    idle = span - busy / 1e9
    print(f"wall {wall:.3f} s under the profiler; first to last kernel {span:.3f} s; GPU busy {busy / 1e9:.3f} s "
          f"({100 * busy / 1e9 / span:.1f}%), idle {idle:.3f} s; {len(kernels)} kernels")
    print(f"\nkernel time by name (top {args.top}):")
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {t:8.3f} s {100 * t / (busy / 1e9):5.1f}%  {n:7d}x  {name}")
    print("\nidle gaps by size:")
    for label, (n, t) in gaps_by_size.items():
        print(f"  {label:>10s}: {n:7d} gaps, {t:.3f} s")
    print(f"\nidle gaps by the kernel that ended them (top {args.top}):")
    for name, (n, t) in sorted(gaps_by_next.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"  {t:8.3f} s  {n:7d} gaps  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"wall_seconds": wall, "span_seconds": span, "busy_seconds": busy / 1e9, "kernels": len(kernels),
                       "by_name": dict(by_name), "gaps_by_size": gaps_by_size, "gaps_by_next": dict(gaps_by_next)},
                      f, indent=1)


if __name__ == "__main__":
    main()
