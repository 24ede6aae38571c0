"""Where an engine step's time goes on the GPU: cProfile of batch-1 decode (graphs and
eager) and of a 256-sequence decode, on random weights with Qwen3-0.6B's shapes.

    python scripts/profile_engine.py      # needs a CUDA GPU
"""
import cProfile
import pstats
import time

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench.throughput import model_checkpoint


def profile(llm, prompts, max_tokens, label, top=18):
    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    steps = max_tokens
    print(f"\n== {label}: {seconds / steps * 1e3:.2f} ms per step ==")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main():
    path = model_checkpoint()
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, 151936, (n,), generator=g).tolist()  # noqa: E731
    for eager in (False, True):
        llm = LLM(str(path), dtype="bfloat16", enforce_eager=eager, gpu_memory_utilization=0.4, max_num_seqs=256)
        profile(llm, [prompt(128)], 64, f"batch 1, {'eager' if eager else 'CUDA graphs'}")
        if not eager:
            profile(llm, [prompt(512) for _ in range(256)], 32, "batch 256, CUDA graphs")
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
