#!/usr/bin/env python
"""What verifying k drafts costs against one decode step (chapter 19), on the model runner's
real path: Qwen3-0.6B's shapes (random weights, bf16), ``--batch-sizes`` sequences each with
``--context`` tokens in the cache, then a step of 1 + k new tokens per sequence (its last
token and k drafts) for k in ``--k``, against a decode step of the same sequences. Each k
gets an engine built for it (speculative_config with num_speculative_tokens=k), so that the
verifying steps replay the verify graphs a real run replays (eager with --enforce-eager);
a decode step replays its decode graph. The forward pass and the LM head over the rows are
timed; sampling is left out (the same small kernels for either). Speculation pays when a
verifying step emits more tokens per sequence (1 + accepted drafts) than the ratio printed
here; with ``--acceptance a`` (the chance that a draft is accepted, from a run on real
text) it prints the speed-up that follows, (1 - a^(k+1)) / (1 - a) / ratio, proposer's
cost left out.

``--family qwen3_5``: the same widths laid out as a hybrid model (three Gated DeltaNet
layers to one attention layer, the linear-attention heads of a Qwen3.5 layer, random
weights), each sequence in a state slot of its own; a verifying step keeps its states for
a rollback, as the engine's do.

With ``--profile`` each step kind also runs under the torch profiler: its kernels' device
time per step, by kernel (the top ``--top``), and how much of the step's wall time the GPU
was busy, so that a verifying step's extra cost can be put on the kernels that carry it.

    python scripts/bench_verify_cost.py [--context 512] [--k 1 2 3 4 6 8] [--batch-sizes 1 4 16 64]
        [--acceptance 0.6] [--family qwen3_5] [--profile] [--out benchmarks/verify_cost.json]
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from minivllm import LLM
from minivllm.bench.gated_delta import QWEN3_5_LAYER
from minivllm.bench.roofline import QWEN3_0_6B
from minivllm.bench.throughput import model_checkpoint
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.step_inputs import StepInputs

HYBRID = QWEN3_0_6B | dict(  # Qwen3-0.6B's widths, Qwen3.5's layout and linear-attention heads
    layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
    linear_num_key_heads=QWEN3_5_LAYER["num_k_heads"], linear_num_value_heads=QWEN3_5_LAYER["num_v_heads"],
    linear_key_head_dim=QWEN3_5_LAYER["dk"], linear_value_head_dim=QWEN3_5_LAYER["dv"])
HYBRID["layer_types"] = HYBRID["layer_types"] * (HYBRID["num_hidden_layers"] // 4)


def step_inputs(context: int, new: int, block_size: int, num_seqs: int) -> StepInputs:
    """num_seqs sequences of ``context`` cached tokens, each computing ``new`` more."""
    total = context + new
    per_seq = -(-total // block_size)
    fields = {name: [] for name in ("input_ids", "positions", "slot_mapping", "context_lens", "logits_indices")}
    fields["cu_seqlens_q"], tables = [0], []
    for i in range(num_seqs):
        table = list(range(i * per_seq, (i + 1) * per_seq))
        positions = list(range(context, total))
        fields["input_ids"] += [(7 * p + i) % 500 for p in positions]  # (any ids: the cost does not depend on them)
        fields["positions"] += positions
        fields["slot_mapping"] += [table[p // block_size] * block_size + p % block_size for p in positions]
        fields["context_lens"].append(total)
        fields["logits_indices"] += range(fields["cu_seqlens_q"][-1], fields["cu_seqlens_q"][-1] + new)
        fields["cu_seqlens_q"].append(fields["cu_seqlens_q"][-1] + new)
        tables.append(table)
    return StepInputs.pack(fields, tables, is_prefill=new > 1, max_seqlen_q=new)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_step(runner, step: StepInputs):
    """Upload ``step`` and run it; a hybrid model's sequences i = 0, 1, ... in state slot i,
    continuing from it, a verifying one keeping a state per draft."""
    input_ids, positions = ModelRunner.upload(runner, step)
    if runner.state_layers:
        n, per_seq = step.num_seqs, step.max_seqlen_q
        rows = [range(n), [1] * n] + ([[per_seq - 1] * n] if per_seq > 1 else [])
        runner._set_state_slots(np.array(rows, dtype=np.int64))
    return runner.execute(input_ids, positions)


def time_step(runner, step: StepInputs, repeats: int, rows: int) -> float:
    """Seconds per forward pass and LM head of ``step``, whose logits have ``rows`` rows."""
    for _ in range(5):  # warm-up
        run_step(runner, step)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        logits, _ = run_step(runner, step)
    sync()
    assert logits.shape[0] == rows
    return (time.perf_counter() - start) / repeats


def profile_step(runner, step: StepInputs, repeats: int, top: int) -> dict:
    """Kernel time per step of ``step``, by kernel, from the torch profiler (CUDA graphs'
    kernels are recorded one by one), and the wall time per step around them."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        run_step(runner, step)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            run_step(runner, step)
        sync()
        wall = (time.perf_counter() - start) / repeats
    kernels = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.self_device_time_total / repeats
        if us > 0:
            kernels[event.key] = (us, event.count / repeats)
    busy = sum(us for us, _ in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {"wall_us": wall * 1e6, "kernel_us": busy, "kernels_per_step": sum(c for _, c in kernels.values()),
            "top": [{"kernel": name[:120], "us": us, "calls": calls} for name, (us, calls) in ranked[:top]]}


def print_profile(label: str, prof: dict) -> None:
    print(f"  {label}: wall {prof['wall_us']:.0f} us/step, kernels {prof['kernel_us']:.0f} us "
          f"({prof['kernels_per_step']:.0f} launches)", flush=True)
    for row in prof["top"]:
        print(f"    {row['us']:8.1f} us  x{row['calls']:<5.0f} {row['kernel'][:100]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--acceptance", type=float, default=None, help="a draft's chance of acceptance, 0..1")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--model", default=None, help="default: Qwen3-0.6B's shapes, random weights")
    parser.add_argument("--family", default="qwen3", choices=["qwen3", "qwen3_5"])
    parser.add_argument("--profile", action="store_true", help="kernel times per step, by kernel")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for k in args.k:
        default = (model_checkpoint() if args.family == "qwen3" else
                   model_checkpoint("qwen3_5-0.6b-widths-random", HYBRID, family="qwen3_5"))
        llm = LLM(args.model or str(default), dtype="bfloat16", max_model_len=None if args.model else 4096,
                  enforce_eager=args.enforce_eager, async_scheduling=False, max_num_seqs=max(args.batch_sizes),
                  speculative_config={"method": "ngram", "num_speculative_tokens": k})
        runner = llm.engine.runner
        for bs in args.batch_sizes:
            decode = time_step(runner, step_inputs(args.context, 1, runner.block_size, bs), args.repeats, bs)
            verify = time_step(runner, step_inputs(args.context, 1 + k, runner.block_size, bs), args.repeats,
                               bs * (1 + k))
            row = {"k": k, "batch_size": bs, "decode_seconds": decode, "verify_seconds": verify,
                   "cost_vs_decode": verify / decode}
            line = f"k={k} batch {bs}: decode {decode * 1e3:.3f} ms, verify {verify * 1e3:.3f} ms ({verify / decode:.2f} x)"
            if args.acceptance is not None:
                a = args.acceptance
                row["speedup_at_acceptance"] = (1 - a ** (k + 1)) / (1 - a) / row["cost_vs_decode"]
                line += f", speed-up at acceptance {a}: {row['speedup_at_acceptance']:.2f}"
            print(line, flush=True)
            if args.profile:
                for label, new in (("decode", 1), ("verify", 1 + k)):
                    row[f"{label}_profile"] = prof = profile_step(
                        runner, step_inputs(args.context, new, runner.block_size, bs), 20, args.top)
                    print_profile(label, prof)
            rows.append(row)
        llm.shutdown()
        if args.out:  # after each k: a run cut short keeps what it measured
            model = args.model or ("random weights, Qwen3-0.6B shapes, bfloat16" if args.family == "qwen3" else
                                   "random weights, Qwen3-0.6B widths in Qwen3.5's hybrid layout, bfloat16")
            report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": model,
                      "context": args.context, "enforce_eager": args.enforce_eager, "acceptance": args.acceptance,
                      "steps": rows}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()
