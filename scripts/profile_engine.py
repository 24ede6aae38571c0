"""Where an engine step's time goes on the GPU, on random weights with Qwen3-0.6B's shapes.

Two views of batch-1 decode (the latency case) and of a 256-sequence decode:
  - the kernel view (torch.profiler): how many kernels one step launches, how long the GPU
    is busy, and the top kernels by GPU time; busy time against wall time is the share of
    the step that the host (Python, the scheduler, the copies) leaves the GPU idle;
  - the host view (cProfile): which Python functions the step's wall time goes to.

    python scripts/profile_engine.py [--cprofile]     # needs a CUDA GPU
"""
import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench.throughput import model_checkpoint


def kernel_view(llm, prompts, max_tokens, label, top=15):
    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels)
    # One prefill step plus max_tokens - 1 decode steps; the per-step figures are for decode.
    print(f"\n== {label}: {wall / max_tokens * 1e3:.3f} ms per step wall, "
          f"GPU busy {busy_us / max_tokens / 1e3:.3f} ms per step ({100 * busy_us / 1e6 / wall:.0f}% of wall), "
          f"{len(kernels) / max_tokens:.0f} kernels per step ==")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=70))


def host_view(llm, prompts, max_tokens, label, top=18):
    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    print(f"\n== {label}: host functions ==")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cprofile", action="store_true", help="also print the host (cProfile) view")
    args = parser.parse_args()
    path = model_checkpoint()
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, 151936, (n,), generator=g).tolist()  # noqa: E731
    llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.4, max_num_seqs=256)
    kernel_view(llm, [prompt(128)], 64, "batch 1, CUDA graphs")
    kernel_view(llm, [prompt(512) for _ in range(256)], 16, "batch 256, CUDA graphs")
    if args.cprofile:
        host_view(llm, [prompt(128)], 64, "batch 1, CUDA graphs")
        host_view(llm, [prompt(512) for _ in range(256)], 16, "batch 256, CUDA graphs")


if __name__ == "__main__":
    main()
