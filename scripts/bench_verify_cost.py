#!/usr/bin/env python
"""What verifying k drafts costs against one decode step (chapter 19), on the model runner's
real path: Qwen3-0.6B's shapes (random weights, bf16), one sequence with ``--context``
tokens in the cache, then a step of 1 + k new tokens (the last token and k drafts) for
k = 0 (a decode step: its CUDA graph) .. ``--max-k`` (a one-sequence chunk: the prefill
graph of the next captured size, or eager with --enforce-eager). The forward pass and the LM
head over the 1 + k rows are timed; sampling is left out (it is the same small kernel for
either). Speculation at batch 1 pays when the accepted length per step, 1 + accepted drafts,
exceeds the ratio printed here.

    python scripts/bench_verify_cost.py [--context 512] [--max-k 8] [--out benchmarks/verify_cost.json]
"""
import argparse
import json
import time
from pathlib import Path

import torch

from minivllm import LLM
from minivllm.bench.throughput import model_checkpoint
from minivllm.engine.model_runner import ModelRunner, StepInputs


def step_inputs(context: int, new: int, block_size: int) -> StepInputs:
    total = context + new
    table = list(range(-(-total // block_size)))
    positions = list(range(context, total))
    fields = {"input_ids": [(7 * p) % 10000 for p in positions], "positions": positions,
              "slot_mapping": [table[p // block_size] * block_size + p % block_size for p in positions],
              "context_lens": [total], "cu_seqlens_q": [0, new], "logits_indices": list(range(new))}
    return StepInputs.pack(fields, [table], is_prefill=new > 1, max_seqlen_q=new)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--model", default=None, help="default: Qwen3-0.6B's shapes, random weights")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(args.model or str(model_checkpoint()), dtype="bfloat16", max_model_len=None if args.model else 4096,
              enforce_eager=args.enforce_eager)
    runner = llm.engine.runner
    rows = []
    for k in range(args.max_k + 1):
        step = step_inputs(args.context, 1 + k, runner.block_size)
        for _ in range(10):  # warm-up
            runner.execute(*ModelRunner.upload(runner, step))
        sync()
        start = time.perf_counter()
        for _ in range(args.repeats):
            logits, _ = runner.execute(*ModelRunner.upload(runner, step))
        sync()
        seconds = (time.perf_counter() - start) / args.repeats
        assert logits.shape[0] == 1 + k
        rows.append({"k": k, "tokens": 1 + k, "seconds": seconds})
    base = rows[0]["seconds"]
    for r in rows:
        r["cost_vs_decode"] = r["seconds"] / base
        print(f"k={r['k']}: {r['seconds'] * 1e3:.3f} ms  ({r['cost_vs_decode']:.2f} x a decode step)", flush=True)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": "random weights, Qwen3-0.6B shapes, bfloat16, batch 1",
              "context": args.context, "enforce_eager": args.enforce_eager,
              "prefill_graph_sizes": getattr(runner, "prefill_graph_sizes", []), "steps": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
