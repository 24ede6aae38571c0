"""Speculative decoding on the bundled model: acceptance, tokens per verifying step and
speed-up, for the n-gram proposer and the draft model, on the CPU or a GPU.

Two workloads from the corpus the bundled model was trained on, greedy: ``copy`` (a
passage, then its first half again: the continuation can copy the rest, as a summary or an
edit copies its source) and ``continue`` (a passage, continued freely). Each is run at each
``--batch-sizes`` (requests generated together; speculation pays most at small batches,
where a decode step is bound by reading the weights, not by computing). In float32 (the
default) every run is checked against speculation off token for token before its speed is
reported; in bfloat16 a verifying chunk and a decode step may round a near tie apart, so
there the share of identical outputs is reported instead (``identical``).

Reported per run: acceptance_rate (accepted drafts / drafts verified), mean_accepted_length
(tokens a verifying step emits: 1 + accepted drafts per step, as vLLM counts it),
tokens_per_s and speedup over speculation off, and propose_share (the part of the
generation's wall time the proposer took: a draft model's forward passes).

    OMP_NUM_THREADS=1 python scripts/bench_spec.py [--device cpu|cuda] [--methods ngram draft]
        [--k 1 2 3 4 5] [--draft minivllm/assets/draft] [--out benchmarks/spec_decode.json]
"""
import argparse
import gc
import json
import platform
import time
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.spec_decode.draft import BUNDLED_DRAFT

# The course's corpus, beside the project (a copy under .out/corpus where it is not).
CORPUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "corpus" / "austen.txt"
if not CORPUS.exists():
    CORPUS = Path(__file__).resolve().parents[1] / ".out" / "corpus" / "austen.txt"


def prompts(kind: str, n: int, chars: int = 600) -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    out = []
    for i in range(n):
        start = text.index(" ", 200_000 + i * 97_003 % (len(text) - 200_000 - 2 * chars)) + 1  # wraps past the end
        passage = text[start : start + chars]
        out.append(passage + "\n\n" + passage[: chars // 2] if kind == "copy" else passage)
    return out


def make_llm(args, speculative_config=None) -> LLM:
    engine_args = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.device == "cuda" else {}
    llm = LLM(device=args.device, dtype=args.dtype, speculative_config=speculative_config, **engine_args)
    llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    return llm


def timed_propose(llm: LLM) -> list[float]:
    """Time the proposer's calls (each ends with its drafts on the host: no sync needed)."""
    spent = [0.0]
    proposer = llm.engine.proposer
    inner = proposer.propose

    def propose(seqs, ks):
        start = time.perf_counter()
        try:
            return inner(seqs, ks)
        finally:
            spent[0] += time.perf_counter() - start

    proposer.propose = propose
    return spent


def generate(llm: LLM, ps: list[str], params: SamplingParams, batch_size: int) -> tuple[list, float]:
    """Generate ps in groups of batch_size; the outputs and the wall time."""
    outs = []
    start = time.perf_counter()
    for i in range(0, len(ps), batch_size):
        outs += llm.generate(ps[i : i + batch_size], params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return outs, time.perf_counter() - start


def release(llm: LLM) -> None:
    llm.engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", help="float32 (outputs checked), or bfloat16 / auto")
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--draft", type=Path, default=BUNDLED_DRAFT, help="the draft model's folder")
    parser.add_argument("--workloads", nargs="+", default=["copy", "continue"], choices=["copy", "continue"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = parser.parse_args()
    if "draft" in args.methods and not (args.draft / "config.json").is_file():
        raise SystemExit(f"--draft {args.draft}: no draft model there (train one with scripts/train_tiny_model.py)")
    configs = []
    for method in args.methods:
        for k in args.k:
            if method == "ngram":
                configs.append({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                "prompt_lookup_max": 3})
            else:
                configs.append({"model": str(args.draft), "num_speculative_tokens": k})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    work = {kind: prompts(kind, args.num_prompts) for kind in args.workloads}

    # Speculation off, once per workload and batch size: the outputs to match and the speed to beat.
    plain = make_llm(args)
    base = {}
    rows = []
    for kind, ps in work.items():
        for bs in args.batch_sizes:
            outs, seconds = generate(plain, ps, params, bs)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            base[kind, bs] = ([o.outputs[0].token_ids for o in outs], tokens / seconds)
            rows.append({"workload": kind, "batch_size": bs, "method": "off", "k": 0,
                         "tokens_per_s": round(tokens / seconds, 1)})
            print(json.dumps(rows[-1]), flush=True)
    release(plain)

    for config in configs:
        llm = make_llm(args, config)
        spent = timed_propose(llm)
        for kind, ps in work.items():
            for bs in args.batch_sizes:
                before, spent[0] = dict(llm.engine.stats), 0.0
                outs, seconds = generate(llm, ps, params, bs)
                want, base_speed = base[kind, bs]
                identical = sum(o.outputs[0].token_ids == w for o, w in zip(outs, want)) / len(want)
                if args.dtype == "float32" and identical < 1:
                    raise SystemExit(f"{config} on {kind} at batch {bs}: outputs differ from speculation off")
                s = {key: llm.engine.stats[key] - before[key] for key in before}
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                rows.append({
                    "workload": kind, "batch_size": bs, "method": llm.engine.speculative.method,
                    "k": config["num_speculative_tokens"], "tokens_per_s": round(tokens / seconds, 1),
                    "speedup": round(tokens / seconds / base_speed, 2),
                    "acceptance_rate": round(s["spec_accepted_tokens"] / max(s["spec_draft_tokens"], 1), 3),
                    "mean_accepted_length": round(1 + s["spec_accepted_tokens"] / max(s["spec_verify_steps"], 1), 2),
                    "propose_share": round(spent[0] / seconds, 3), "identical": identical,
                })
                print(json.dumps(rows[-1]), flush=True)
        release(llm)

    if args.out is not None:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
        result = {"what": "speculative decoding on the bundled model (scripts/bench_spec.py), greedy",
                  "device": device, "dtype": args.dtype, "draft": str(args.draft),
                  "max_tokens": args.max_tokens, "num_prompts": args.num_prompts, "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
