#!/usr/bin/env python
"""Where a step's time goes with speculative decoding on the bundled model (chapter 19).

For speculation off (asynchronous and synchronous loops), n-gram and the shipped draft
model, at each ``--batch-sizes``: tokens per second, milliseconds per engine step, the mean
accepted length, and the host time per step in each part of the step (the proposer, the
scheduler, ``prepare``, ``execute``, the sampler's launch, processing the outputs). The
parts are timed by wrapping the engine's own methods, so they are host time: on a GPU
``execute`` launches a graph and returns, and the wait for the device falls in whichever
part first needs its results. The prompts are ``scripts/bench_spec.py``'s ``copy``
workload, greedy, 64 tokens each.

    OMP_NUM_THREADS=1 python scripts/profile_spec.py [--device cuda] [--dtype bfloat16] [--batch-sizes 1 8] [--k 3]
"""
import argparse
import collections
import gc
import time

import torch

from bench_spec import prompts
from minivllm import LLM, SamplingParams
from minivllm.spec_decode.draft import BUNDLED_DRAFT

PARTS = [("engine", "step"), ("speculation", "before_schedule"), ("scheduler", "schedule"), ("runner", "prepare"),
         ("runner", "execute"), ("runner", "sample"), ("engine", "update")]


def timed_parts(engine) -> collections.Counter:
    """Wrap the engine's parts so that each call adds its seconds to the returned counter
    (and ``calls[name]`` counts them)."""
    seconds = collections.Counter()
    owners = {"engine": engine, "speculation": engine.speculation, "scheduler": engine.scheduler,
              "runner": engine.runner}
    for owner, name in PARTS:
        obj = owners[owner]
        if not hasattr(obj, name):
            continue
        inner = getattr(obj, name)

        def wrapped(*args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - start
                seconds["calls:" + _name] += 1

        setattr(obj, name, wrapped)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    ps = prompts("copy", args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    configs = [("off, asynchronous", None, {}), ("off, synchronous", None, {"async_scheduling": False}),
               (f"n-gram k={args.k}", {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3}, {}),
               (f"draft k={args.k}", {"model": str(BUNDLED_DRAFT), "num_speculative_tokens": args.k}, {})]
    engine_args = {"gpu_memory_utilization": 0.3} if args.device.startswith("cuda") else {}
    for bs in args.batch_sizes:
        for label, spec, extra in configs:
            llm = LLM(device=args.device, dtype=args.dtype, speculative_config=spec, **engine_args, **extra)
            llm.generate(ps[:1], params, use_tqdm=False)  # warm-up
            engine = llm.engine
            seconds = timed_parts(engine)
            before = dict(engine.stats)
            sync()
            start = time.perf_counter()
            outs = []
            for i in range(0, len(ps), bs):
                outs += llm.generate(ps[i : i + bs], params, use_tqdm=False)
            sync()
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = seconds["calls:step"]
            accepted = 1.0
            if spec is not None:
                s = {key: engine.stats[key] - before[key] for key in ("spec_accepted_tokens", "spec_verify_steps")}
                accepted = 1 + s["spec_accepted_tokens"] / max(s["spec_verify_steps"], 1)
            parts = ", ".join(f"{name.lstrip('_')} {seconds[name] / steps * 1e3:.3f}"
                              for _, name in PARTS[1:] if seconds["calls:" + name])
            print(f"batch {bs}, {label}: {tokens / wall:.0f} tok/s, {wall / steps * 1e3:.3f} ms/step, "
                  f"accepted length {accepted:.2f}\n    host ms per step: {parts}", flush=True)
            engine.shutdown()
            del llm, engine
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
