#!/usr/bin/env python
"""One variant of the decode step against another, on a CUDA GPU: the decode graph's time.

Random weights with Qwen3-0.6B's shapes, bfloat16, ``max_model_len`` 8192, greedy. One
variant a process (run the script once per variant, in one call, for a comparison):
- ``graph_ms_b1``, ``graph_ms_b8``: the decode graph of 1 and 8 sequences replayed 200 times
  back to back, timed by CUDA events (best of three);
- ``ms_per_step_b1``, ``ms_per_step_b8``: a 257-token generation less a 1-token one, over 256
  steps (best of two), prompts of 128 tokens;
- ``tokens``: 8 prompts' greedy tokens (48 each), to compare between variants.

A variant is ``base`` (the package as it is) or parts joined by ``+``, each patched in before
the engine is built:
- ``g:<elements>:<warps>:<stages>``: a one-row gemv takes a program's whole row of W (K to
  a power of two, at most 4,096) as one tile of ``elements``;
- ``n:<block_n>:<warps>:<stages>``: a one-row gemv with BLOCK_N columns a program, its BLOCK_K
  as the package sets it;
- ``m:<block_n>:<block_k>:<warps>:<stages>``: a gemv of 5 to 16 rows (the tensor-core path)
  takes that tile (a gated one half the columns);
- ``gw<warps>``: the gated gemv (gate/up ending in SwiGLU) of 5 to 16 rows runs its tile on
  ``warps`` warps;
- ``s<count>``: the decode attention takes at most ``count`` splits;
- ``p<count>``: its split rule aims at ``count`` programs a multiprocessor (the package: 12).
CONTEXT (default 128) is the prompts' length: the decode graph's attention reads that many
keys a sequence and more.
An older engine: export its package beside the tree (``git archive <commit> minivllm | tar
-x -C old/``), copy this script and ``profile_decode_step.py`` into ``old/`` and run it there.

    python scripts/ab_decode_graph.py VARIANT OUT.json [CONTEXT]
"""
import json
import sys
import time
from pathlib import Path

import torch
import triton

# The script's folder first (profile_decode_step.py, and an exported older package), then this
# tree's package, not an installed one.
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from minivllm.kernels import gemv, paged_attention  # noqa: E402
from profile_decode_step import graph_replay_ms  # noqa: E402  (the script beside this one)


def patch_gemv(kind: str, value: int, warps: int, stages: int) -> None:
    package_config = gemv.gemv_config

    def config(n: int, k: int, rows: int = 2) -> dict:
        c = package_config(n, k, rows)
        if rows == 1:
            if kind == "g":
                block_k = min(4096, triton.next_power_of_2(k))
                c = {**c, "BLOCK_K": block_k, "BLOCK_N": max(1, value // block_k)}
            else:
                c = {**c, "BLOCK_N": value}
            c = {**c, "num_warps": warps, "num_stages": stages}
        return c

    gemv.gemv_config = config


def patch_rows_gemv(block_n: int, block_k: int, warps: int, stages: int) -> None:
    package_config = gemv.gemv_config

    def config(n: int, k: int, rows: int = 2) -> dict:
        c = package_config(n, k, rows)
        if rows > gemv.SUM_ROWS:
            c = {"DOT": True, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}
        return c

    gemv.gemv_config = config


def patch_splits(cap: int) -> None:
    package_splits = paged_attention.decode_num_splits
    paged_attention.decode_num_splits = lambda *args, **kwargs: min(cap, package_splits(*args, **kwargs))


def patch_gated_warps(warps: int) -> None:
    package_config = gemv.gated_config

    def config(n: int, k: int, rows: int = 2) -> dict:
        c = package_config(n, k, rows)
        return {**c, "num_warps": warps} if rows > gemv.SUM_ROWS else c

    gemv.gated_config = config


def apply(variant: str) -> None:
    for part in variant.split("+"):
        if part.startswith(("g:", "n:")):
            kind, value, warps, stages = part.split(":")
            patch_gemv(kind, int(value), int(warps), int(stages))
        elif part.startswith("m:"):
            patch_rows_gemv(*(int(v) for v in part.split(":")[1:]))
        elif part.startswith("gw") and part[2:].isdigit():
            patch_gated_warps(int(part[2:]))
        elif part.startswith("s") and part[1:].isdigit():
            patch_splits(int(part[1:]))
        elif part.startswith("p") and part[1:].isdigit():
            paged_attention.SPLIT_PROGRAMS_PER_SM = int(part[1:])
        elif part != "base":
            raise SystemExit(f"unknown variant part {part!r} (base, g:E:W:S, n:B:W:S, m:B:K:W:S, gwN, sN, pN)")


def measure(context: int) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.bench.throughput import model_checkpoint
    llm = LLM(str(model_checkpoint()), dtype="bfloat16", gpu_memory_utilization=0.5, max_num_seqs=8,
              max_model_len=8192)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.runner.model_config.vocab_size
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(8)]
    report = {"tokens": [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(48), use_tqdm=False)]}
    for batch in (1, 8):
        report[f"graph_ms_b{batch}"] = min(graph_replay_ms(llm, batch) for _ in range(3))

        def run(n: int) -> float:
            t0 = time.perf_counter()
            llm.generate(prompts[:batch], greedy(n), use_tqdm=False)
            return time.perf_counter() - t0

        first, total = min(run(1) for _ in range(2)), min(run(257) for _ in range(2))
        report[f"ms_per_step_b{batch}"] = 1000 * (total - first) / 256
    llm.shutdown()
    return report


def main() -> None:
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    variant, out = sys.argv[1:3]
    context = int(sys.argv[3]) if len(sys.argv) == 4 else 128
    apply(variant)
    report = {"variant": variant, "context": context, "device": torch.cuda.get_device_name(), **measure(context)}
    print(json.dumps({k: v for k, v in report.items() if k != "tokens"}))
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
