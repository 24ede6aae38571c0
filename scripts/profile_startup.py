"""Where the engine's start-up goes, function by function: builds ``LLM`` on the throughput
benchmark's checkpoint under Python's profiler and prints the start-up phases and the
functions that took the most time in them (their own time, and with what they call).

    python scripts/profile_startup.py [--top 25] [--out startup_profile.txt]

The phases (``ModelRunner.startup_seconds``) say which part is slow; the profile says why:
Triton compiling, CUDA graph capture and instantiation, synchronizations, the allocator
giving memory back, the garbage collector.
"""
import argparse
import cProfile
import io
import pstats
import time

from minivllm import LLM
from minivllm.bench.throughput import model_checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    path = model_checkpoint()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm = LLM(str(path), dtype="bfloat16", max_model_len=4096)
    profiler.disable()
    seconds = time.perf_counter() - start
    report = io.StringIO()
    report.write(f"LLM(...) took {seconds:.2f} s; phases: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in llm.engine.runner.startup_seconds.items()) + "\n")
    stats = pstats.Stats(profiler, stream=report)
    for order in ("tottime", "cumulative"):
        report.write(f"\n--- by {order} ---\n")
        stats.sort_stats(order).print_stats(args.top)
    text = report.getvalue()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
