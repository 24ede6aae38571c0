#!/usr/bin/env python
"""Where a small-batch decode step's time goes, on a CUDA GPU: the GPU's share and the host's.

Random weights with Qwen3-0.6B's shapes, bfloat16, greedy, prompts of 128 tokens. For each
batch size (1, 8 and 64 sequences):
- ``ms_per_step``: a 257-token generation less a 1-token one, over 256 steps (best of three);
- ``host_ms_per_step``: the host's time in each part of the step (the engine's ``schedule``,
  ``execute`` and ``update``, the runner's ``prepare`` and ``sample``, the graph's replay
  call, and ``_wait_for``: waiting for the sampled tokens), from wrappers around them on a
  generation of 257 tokens (``instrumented_ms_per_step`` is that run's time a step);
- ``graph_replay_gpu_ms``: the decode graph of that batch size replayed 200 times back to
  back, timed by CUDA events: the GPU's time for the model's layers alone (the LM head and
  the sampler run outside the graph).
A step is bound by the GPU when the host waits for its tokens (``_wait_for`` large), by the
host when it does not. With ``--ops`` it also times the host's cost of one call of the
step's small operations on an idle GPU (synchronised, one call timed, the median of 300).
With ``--kernels`` it lists the decode graph's kernels from the profiler (per replay: each
kernel's count and GPU time, their sum, and the replay's span: where the span is longer than
the sum, the GPU sat idle between kernels; under PDL kernels overlap and the sum can exceed
it), with one layer's kernels in order. ``MINIVLLM_PDL=0`` runs it without PDL, to compare.

    python scripts/profile_decode_step.py --async-scheduling on|off [--ops] [--kernels] [--out FILE]
"""
import argparse
import collections
import json
import os
import time

import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.bench.roofline import timed
from minivllm.bench.throughput import model_checkpoint
from minivllm.engine.cuda_graphs import DECODE, GraphKey


def wrap(obj, name: str, totals: dict) -> None:
    """Add the time of each call of obj.name to totals[name] (an attribute on the instance)."""
    original = getattr(obj, name)

    def timed_call(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        totals[name] += time.perf_counter() - start
        return result

    setattr(obj, name, timed_call)


def graph_replay_ms(llm, batch: int) -> float:
    graph = llm.engine.runner.cudagraphs.graphs[GraphKey(DECODE, batch)]
    torch.cuda.synchronize()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 200


def graph_kernels(llm, batch: int, replays: int = 20) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph = llm.engine.runner.cudagraphs.graphs[GraphKey(DECODE, batch)]
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start),
                    key=lambda e: e.time_range.start)
    if not events:
        return {"error": "the profiler recorded no kernel of the graph's replays"}
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        per_name[e.name][0] += 1
        per_name[e.name][1] += e.time_range.end - e.time_range.start
    per_replay = len(events) // replays
    layers = llm.engine.runner.model_config.num_hidden_layers
    one_replay = events[:per_replay]
    per_layer = (per_replay - 2) // layers  # (the embedding before the layers, the final norm after)
    middle = per_replay // 2 - per_replay // 2 % per_layer if per_layer else 0
    return {
        "kernels_per_replay": per_replay,
        "busy_us_per_replay": sum(e.time_range.end - e.time_range.start for e in events) / replays,
        "span_us_per_replay": (events[-1].time_range.end - events[0].time_range.start) / replays,
        "by_kernel": {name: {"per_replay": count / replays, "us_each": total / count}
                      for name, (count, total) in sorted(per_name.items(), key=lambda kv: -kv[1][1])},
        "a_middle_layer": [(e.name[:80], round(e.time_range.end - e.time_range.start, 2),
                            round(e.time_range.start - one_replay[middle].time_range.start, 2))
                           for e in one_replay[middle: middle + per_layer + 1]],
    }


def profile_steps(async_scheduling: bool, batch_sizes: list[int], kernels: bool = False) -> dict:
    llm = LLM(str(model_checkpoint()), dtype="bfloat16", gpu_memory_utilization=0.5, max_num_seqs=max(batch_sizes),
              max_model_len=8192, async_scheduling=async_scheduling)
    engine, runner = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([torch.randint(0, vocab, (128,), generator=g).tolist()], greedy(32), use_tqdm=False)  # warm-up
    report = {"async_scheduling": async_scheduling}
    for batch in batch_sizes:
        prompts = [torch.randint(0, vocab, (128,), generator=g).tolist() for _ in range(batch)]
        run = lambda n: timed(lambda: llm.generate(prompts, greedy(n), use_tqdm=False))[1]  # noqa: E731
        first = min(run(1) for _ in range(3))
        total = min(run(257) for _ in range(3))
        totals = collections.defaultdict(float)
        targets = [(engine, n) for n in ("step", "schedule", "execute", "update", "_wait_for")]
        targets += [(runner, "prepare"), (runner, "sample"), (runner.cudagraphs, "replay")]
        for obj, name in targets:
            wrap(obj, name, totals)
        instrumented = run(257)
        for obj, name in targets:
            delattr(obj, name)  # the class's method again
        report[f"batch_{batch}"] = {
            "ms_per_step": 1000 * (total - first) / 256,
            "instrumented_ms_per_step": 1000 * instrumented / 257,
            "host_ms_per_step": {name: 1000 * seconds / 257 for name, seconds in totals.items()},
            "graph_replay_gpu_ms": graph_replay_ms(llm, batch),
        }
        if kernels:
            report[f"batch_{batch}"]["graph_kernels"] = graph_kernels(llm, batch)
    llm.shutdown()
    return report


def host_us(fn, calls: int = 300) -> float:
    """The host's time for one call of fn, the GPU idle before it (median of ``calls``)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[len(times) // 2]


def gpu_us(fn, calls: int = 50) -> float:
    """Back-to-back calls timed by CUDA events: the GPU's time a call where the GPU is the
    slower side, the host's where the host is."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / calls


def profile_ops() -> dict:
    from minivllm.kernels.gemv import gemv
    from minivllm.kernels.sampling import gumbel_argmax

    ops = {}
    for rows in (1, 8):
        logits = torch.randn(rows, 151936, device="cuda", dtype=torch.bfloat16)
        ones, seeds = torch.ones(rows, device="cuda"), torch.zeros(rows, dtype=torch.int64, device="cuda")
        hidden = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        head = torch.randn(151936, 1024, device="cuda", dtype=torch.bfloat16)
        ops[f"rows_{rows}"] = {
            "argmax_host_us": host_us(lambda: logits.argmax(dim=-1)),
            "gumbel_argmax_host_us": host_us(lambda: gumbel_argmax(logits, ones, ones, seeds)),
            "lm_head_cublas_host_us": host_us(lambda: F.linear(hidden, head)),
            "lm_head_gemv_host_us": host_us(lambda: gemv(hidden, head)),
            "lm_head_cublas_gpu_us": gpu_us(lambda: F.linear(hidden, head)),
            "lm_head_gemv_gpu_us": gpu_us(lambda: gemv(hidden, head)),
        }
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--async-scheduling", choices=["on", "off"], default="on")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--ops", action="store_true", help="also time the host's cost of the step's small operations")
    parser.add_argument("--kernels", action="store_true", help="also list the decode graph's kernels (profiler)")
    parser.add_argument("--out", help="write the report here (JSON) as well as printing it")
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(),
              "pdl": os.environ.get("MINIVLLM_PDL", "1") != "0",
              **profile_steps(args.async_scheduling == "on", args.batch_sizes, args.kernels)}
    if args.ops:
        report["ops"] = profile_ops()
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
