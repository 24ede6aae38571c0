#!/usr/bin/env python
"""What constrained decoding costs (chapter 18): the throughput workload with a JSON schema on
every request against the same workload with none, and the grammar's compile time.

The model has Qwen3-0.6B's shapes and random weights (minivllm.bench.throughput) and, unless
``--tokenizer`` names a folder with Qwen3's tokenizer (tokenizer.json and tokenizer_config.json,
151,669 tokens), the bundled model's: the grammar needs a vocabulary to speak of, and no Qwen
tokenizer travels with the course. The logits are Qwen3's 151,936 wide, so the bitmask's
upload and the kernel cost what they would with Qwen's tokenizer; with the bundled one the
matchers' mask filling works over 8,192 real tokens instead of 151,669, so it is cheaper than
with Qwen's vocabulary (about 15 us a row inside a string on a CPU core,
scripts/profile_structured_host.py; the compile time more so).

Both runs: 256 requests, prompts of 100..1024 random tokens, temperature 0.6, max_tokens
100..1024. A random model rarely draws EOS, so the plain run makes max_tokens tokens; the
constrained one may finish its JSON early, so the comparison is per output token and per
decode step (the median of the steps that decode the full batch of 256).

    python scripts/bench_structured.py [--num-requests 256] [--out benchmarks/structured.json] [--sync]
                                       [--tokenizer DIR]
"""
import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from minivllm.bench.throughput import make_workload, model_checkpoint

# An object whose strings are free: the mask is dense (most tokens allowed) inside them and
# sparse between them, the usual mix of a JSON answer.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "summary": {"type": "string"}},
    "required": ["title", "year", "tags", "summary"]}


def checkpoint_with_tokenizer(tokenizer: str | None = None) -> Path:
    """The random Qwen3-0.6B checkpoint with a tokenizer's files beside it (the bundled
    model's, or those in the folder ``tokenizer``)."""
    model = model_checkpoint()
    source = Path(tokenizer) if tokenizer else Path(__file__).resolve().parents[1] / "minivllm" / "assets" / "bundled"
    folder = model.parent / ("qwen3-0.6b-random-given-tokenizer" if tokenizer else "qwen3-0.6b-random-bundled-tokenizer")
    if not (folder / "config.json").exists():
        shutil.copytree(model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (again each run: the folder given may differ)
        shutil.copy(source / name, folder / name)
    return folder


def run(llm, prompts, params) -> dict:
    llm.engine.trace.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    full = [s.seconds for s in llm.engine.trace if not s.num_prefill_tokens and len(s.seqs) == len(prompts)]
    decode = [s.seconds for s in llm.engine.trace if not s.num_prefill_tokens]
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "steps": len(llm.engine.trace), "decode_steps": len(decode),
            "median_decode_step_s": statistics.median(decode) if decode else None,
            "full_batch_decode_steps": len(full),
            "median_full_batch_decode_step_s": statistics.median(full) if full else None,
            "finish_reasons": {r: sum(o.outputs[0].finish_reason == r for o in outputs) for r in ("stop", "length")},
            "_outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/structured.json")
    parser.add_argument("--sync", action="store_true", help="also measure with async_scheduling=False")
    parser.add_argument("--tokenizer", help="a folder with Qwen3's tokenizer files (default: the bundled tokenizer)")
    args = parser.parse_args()
    from minivllm import LLM, SamplingParams
    from minivllm.structured import StructuredOutputsParams

    path = checkpoint_with_tokenizer(args.tokenizer)
    prompts, lens = make_workload(args.num_requests, max_token_id=8191)
    warm, _ = make_workload(16, seed=12345, max_token_id=8191)
    so = StructuredOutputsParams(json=SCHEMA)
    report = {"device": torch.cuda.get_device_name(), "schema": SCHEMA,
              "tokenizer": args.tokenizer or "bundled (8,192 tokens)"}
    for async_scheduling in (True, False) if args.sync else (True,):
        llm = LLM(str(path), dtype="bfloat16", record_trace=True, max_num_seqs=256, max_num_batched_tokens=16384,
                  async_scheduling=async_scheduling)
        # The compile, first (a cold cache), then a warm-up of both kinds of request.
        start = time.perf_counter()
        compiler = llm.engine.grammar_compiler()
        tokenizer_info_s = time.perf_counter() - start
        compiler.compile(so)
        compile_s = compiler.compile_seconds[-1]
        start = time.perf_counter()
        compiler.compile(so)
        cached_s = time.perf_counter() - start
        for s in (None, so):
            llm.generate(warm, SamplingParams(max_tokens=16, structured_outputs=s), use_tqdm=False)
        plain = run(llm, prompts, [SamplingParams(temperature=0.6, max_tokens=n) for n in lens])
        constrained = run(llm, prompts, [SamplingParams(temperature=0.6, max_tokens=n, structured_outputs=so)
                                         for n in lens])
        valid = 0
        for o in constrained.pop("_outputs"):
            if o.outputs[0].finish_reason == "stop":
                json.loads(o.outputs[0].text)  # raises if the grammar let anything else through
                valid += 1
        plain.pop("_outputs")
        one = {"vocab_size": llm.engine.runner.model_config.vocab_size, "tokenizer_tokens": len(llm.get_tokenizer()),
               "tokenizer_info_seconds": tokenizer_info_s, "compile_seconds": compile_s,
               "cached_compile_seconds": cached_s, "plain": plain, "json_schema": constrained,
               "json_outputs_parsed": valid,
               "output_tokens_per_s_ratio": constrained["output_tokens_per_s"] / plain["output_tokens_per_s"]}
        p, c = plain["median_full_batch_decode_step_s"], constrained["median_full_batch_decode_step_s"]
        if p and c:
            one["full_batch_step_overhead"] = c / p - 1
        report["async" if async_scheduling else "sync"] = one
        print(json.dumps({k: v for k, v in one.items() if not isinstance(v, dict)}), flush=True)
        llm.shutdown()
        del llm
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
