# Exercise copy of minivllm/bench/throughput.py, generated from it by scripts/make_exercises.py.
# Fill in: speed_of_light (ch15).
# Grade: make grade CH=15
# Running the generator again overwrites this file: commit or copy your work first.

"""Offline throughput on nano-vllm's standard workload, against the roofline and transformers.

Workload: 256 requests, prompt and output lengths each uniform in [100, 1024], random token
ids, ignore_eos, temperature 0.6, on a random-weight model with Qwen3-0.6B's exact shapes in
bfloat16 (speed does not depend on the weights' values).

Speed of light: every engine step must at least read the weights once and read the K/V
of every token in every sequence's context (at the KV cache's dtype: a float8 cache's bytes
are half a bf16 one's), and must do 2 FLOPs per weight per token plus
the attention FLOPs. Each step's floor is max(bytes / bandwidth, FLOPs / matmul rate) with
both ceilings measured in this run; the workload's floor is the sum over the engine's real
steps. "% of speed of light" = that floor / the measured time.
"""
import gc
import os
import random
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from minivllm.bench.roofline import (QWEN3_0_6B, measure_ceilings, release_memory, report_name, save_report, timed,
                                     weight_bytes)
from minivllm.testing import make_tiny_checkpoint


def make_workload(num_requests: int = 256, min_len: int = 100, max_len: int = 1024, max_token_id: int = 10000,
                  seed: int = 0):
    """nano-vllm's bench.py workload, draw for draw: Python's random seeded with ``seed``, then
    each prompt's length and ids (``randint(0, 10000)``), then each request's max_tokens. With
    the defaults: 142,827 prompt tokens and 133,966 output tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_requests)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, output_lens


def fresh_prompts(prompts, seed: int, max_token_id: int = 10000):
    """Prompts of the same lengths with other ids: the same work again, with nothing for
    the prefix cache to find."""
    rng = random.Random(seed)
    return [[rng.randint(0, max_token_id) for _ in p] for p in prompts]


def model_checkpoint(name: str = "qwen3-0.6b-random", shapes: dict = QWEN3_0_6B, family: str = "qwen3") -> Path:
    """A random-weight bf16 checkpoint of ``shapes`` (default: Qwen3-0.6B's), written once
    into the cache folder (``MINIVLLM_CACHE``, else ~/.cache/minivllm) and reused."""
    folder = Path(os.environ.get("MINIVLLM_CACHE", Path.home() / ".cache" / "minivllm")) / name
    if not (folder / "config.json").exists():
        make_tiny_checkpoint(folder, family=family, dtype=torch.bfloat16, init_std=0.02, **shapes)
    return folder


def speed_of_light(trace, model_config, params: int, ceilings: dict, dtype_bytes: int = 2,
                   weight_bytes: float | None = None, kv_dtype_bytes: int | None = None) -> dict:
    """The floor time of the engine's actual steps (see the module docstring). Weights are
    read at ``weight_bytes`` (what they are stored in, ``roofline.weight_bytes``: fewer than
    params * dtype_bytes with fp8 linear layers; that product if not given), keys and values
    at the KV cache's ``kv_dtype_bytes`` an element (default ``dtype_bytes``; 1 for a float8
    cache, whose floor is then that much lower)."""
    weight_bytes = params * dtype_bytes if weight_bytes is None else weight_bytes
    kv_dtype_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    raise NotImplementedError(
        "ch15: one step's floor, its speed of light: a step cannot beat the time to move its bytes "
        "at the measured copy bandwidth, nor the time to do its FLOPs at the measured matmul rate, "
        "so its floor is the larger of the two. Bytes: every weight once, plus the keys and values "
        "it reads (step.kv_tokens_read tokens; a cached token is a key and a value per layer, each "
        "num_key_value_heads times head_dim elements of dtype_bytes). FLOPs: two per body "
        "parameter (every parameter but the embedding matrix, vocab_size by hidden_size) per token "
        "the step computes (the second field of each of step.seqs), two per embedding parameter "
        "per sampled row (the LM head; one row per sequence of the step), and four per (query, "
        "key) pair (step.attention_pairs), per layer, attention head and head dimension (the two "
        "attention matmuls). Sum the bytes, the FLOPs and the steps' floors over the trace, and "
        "return them as a dict with the keys bytes, flops and floor_seconds; the two rates are in "
        "the ceilings dict. Pitfalls: adding the two times assumes memory and compute never "
        "overlap; the floor of the totals is not the sum of the steps' floors, see "
        "notebooks/15_speed_of_light.ipynb"
    )


# bench.py's warm-up: ``llm.generate(["Benchmark: "], SamplingParams())``, one short
# prompt with the default parameters (here as ids: the random-weight model has no tokenizer).
WARMUP_PROMPT = [[33, 8934, 25, 220]]


@contextmanager
def gc_pauses():
    """Collect, in the dict this yields, how often the cyclic garbage collector ran inside
    the block, per generation, and how long it stalled the process in all and at most. A
    full collection walks every tracked object (hundreds of thousands with torch loaded);
    inside a timed run it is a step that takes a tenth of a second longer."""
    pauses = {"collections": [0, 0, 0], "seconds": 0.0, "longest_seconds": 0.0, "full_collections_at": []}
    started = []

    def callback(phase, info):
        if phase == "start":
            if info["generation"] == 2:  # where a full collection struck (the code's frames only)
                frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]]
                pauses["full_collections_at"].append(frames[-8:])
            started.append(time.perf_counter())
        elif started:
            took = time.perf_counter() - started.pop()
            pauses["collections"][info["generation"]] += 1
            pauses["seconds"] += took
            pauses["longest_seconds"] = max(pauses["longest_seconds"], took)

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def timed_run(llm, prompts, output_lens) -> dict:
    """One timed ``generate`` of the workload, as bench.py times it, with what it compiled
    and how its time split between steps with prefill work and decode-only steps."""
    from minivllm import SamplingParams
    from minivllm.bench.compiles import triton_compiles

    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    before = dict(llm.engine.stats)
    # cudaMalloc calls inside the run (the caching allocator growing): each can leave the GPU idle.
    def device_allocations() -> int:
        return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0

    before_allocs = device_allocations()
    with triton_compiles() as compiled, gc_pauses() as collector:
        outputs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    device_allocs = device_allocations() - before_allocs
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert output_tokens == sum(output_lens), "every request must produce exactly max_tokens tokens"
    stats = {k: llm.engine.stats[k] - before.get(k, 0) for k in ("prefill_seconds", "decode_seconds")}
    return {"output_tokens": output_tokens, "seconds": seconds, "output_tokens_per_s": output_tokens / seconds,
            "prefill_step_seconds": stats["prefill_seconds"], "decode_step_seconds": stats["decode_seconds"],
            "triton_compiles": len(compiled), "compiled": sorted(set(c.split("[")[0] for c in compiled)),
            "garbage_collector": collector, "device_allocations": device_allocs}


def gpu_busy(llm, prompts, output_lens) -> dict:
    """The workload once more under torch.profiler: how long the GPU ran kernels (the union
    of their intervals) against the wall time. The profiler slows the host, so this run's
    own wall time is reported beside it and is not the throughput."""
    from torch.profiler import ProfilerActivity, profile

    from minivllm import SamplingParams

    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    spans = sorted((e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type().name == "CUDA" and e.name() and not e.name().startswith("Memcpy"))
    busy, end = 0, 0
    for s0, s1 in spans:
        if s1 > end:
            busy += s1 - max(s0, end)
            end = s1
    return {"wall_seconds_under_profiler": wall, "gpu_busy_seconds": busy / 1e9, "kernels": len(spans)}


def run_minivllm(path: Path, prompts, output_lens, enforce_eager: bool = False, second_run: bool = True,
                 profile_gpu: bool = False, **engine_args) -> dict:
    """bench.py's procedure: build the engine, its one-prompt warm-up, then the timed run,
    the first thing the user's engine does. Then the same work with fresh prompts (the
    second run, with the per-step trace that the speed of light is computed from)."""
    from minivllm import LLM, SamplingParams
    from minivllm.bench.compiles import triton_compiles

    start = time.perf_counter()
    with triton_compiles() as compiled:
        llm = LLM(str(path), dtype="bfloat16", enforce_eager=enforce_eager, max_model_len=4096, **engine_args)
    startup = time.perf_counter() - start
    llm.generate(WARMUP_PROMPT, SamplingParams(), use_tqdm=False)
    torch.cuda.reset_peak_memory_stats()
    # Start-up by phase (the model runner's; the rest of `startup` is the tokenizer and the
    # engine's own set-up), and the kernels Triton compiled or loaded from its cache in it.
    result = {"startup_seconds": startup, "startup_phases": dict(llm.engine.runner.startup_seconds),
              "startup_triton_compiles": len(compiled), "first_run": timed_run(llm, prompts, output_lens)}
    if second_run:
        llm.engine.config.record_trace = True
        result["second_run"] = timed_run(llm, fresh_prompts(prompts, seed=1), output_lens)
        llm.engine.config.record_trace = False
    trace = llm.engine.trace
    if profile_gpu:
        result["gpu_busy"] = gpu_busy(llm, fresh_prompts(prompts, seed=2), output_lens)
    model = llm.engine.runner.model
    result.update({
        **result["first_run"],  # the headline numbers: the user's first run
        "steps": len(trace),
        # Steps of the second run, slowest first: where one-time work would show.
        "slowest_steps": [{"step": s.step, "seconds": s.seconds, "prefill_tokens": s.num_prefill_tokens,
                           "sequences": len(s.seqs)} for s in sorted(trace, key=lambda s: s.seconds, reverse=True)[:5]],
        "peak_memory_bytes": torch.cuda.max_memory_allocated(),
        "kv_blocks": llm.engine.runner.num_kv_blocks,
        "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
        "_kv_dtype_bytes": llm.engine.runner.kv_cache.element_size(),
        "enforce_eager": enforce_eager,
        "async_scheduling": llm.engine.config.async_scheduling,
        # The step budget the engine resolved (its default depends on the device).
        "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
        "_trace": trace,
        "_params": sum(p.numel() for p in model.parameters()),
        "_weight_bytes": weight_bytes(model),
        "_config": model.config,
    })
    llm.engine.runner.shutdown()
    del llm, model
    release_memory()
    return result


def run_transformers(path: Path, prompts, output_lens, num_requests: int = 32) -> dict:
    """The same model through transformers, on the first ``num_requests`` requests (the full
    workload through padded generate would take minutes). Two ways: continuous batching
    (``generate_batch``) and one padded ``generate`` batch."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompts, output_lens = prompts[:num_requests], output_lens[:num_requests]
    results = {"num_requests": num_requests}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    # Padded generate: one batch, left-padded, every row runs to the longest output.
    pad = 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    with torch.inference_mode():
        _, t = timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=max(output_lens),
                                            min_new_tokens=max(output_lens), do_sample=True, temperature=0.6,
                                            top_k=0, top_p=1.0, pad_token_id=pad))
    results["padded_generate"] = {"seconds": t, "useful_output_tokens": sum(output_lens),
                                  "output_tokens_per_s": sum(output_lens) / t}
    # Continuous batching: one config for all requests, so every request generates the
    # mean output length (same total tokens as the workload subset).
    try:
        model2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="paged|sdpa").cuda().eval()
        mean_len = round(sum(output_lens) / len(output_lens))
        config = GenerationConfig(max_new_tokens=mean_len, min_new_tokens=mean_len, do_sample=True, temperature=0.6,
                                  top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=0)
        out, t = timed(lambda: model2.generate_batch(inputs=prompts, generation_config=config, progress_bar=False))
        tokens = sum(len(o.generated_tokens) for o in out.values())
        results["generate_batch"] = {"seconds": t, "output_tokens": tokens, "output_tokens_per_s": tokens / t}
        del model2
    except Exception as e:  # recorded, not hidden: the report shows why this baseline is missing
        results["generate_batch"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    del model
    release_memory()
    return results


def main(out_dir: str = "benchmarks", with_transformers: bool = True, num_requests: int = 256,
         profile_gpu: bool = True, engine_args: dict | None = None, kv_cache_dtype: str | None = None) -> dict:
    """The workload on the engine (``engine_args``: EngineConfig fields; ``kv_cache_dtype``,
    one of them, and ``quantization`` also name the report (``roofline.report_name``:
    throughput.json in the model's dtype, throughput_kv_fp8.json for a float8 cache,
    throughput_w_fp8.json for fp8 weights, throughput_kv_fp8_w_fp8.json for both), so each
    format's run is kept beside the others)."""
    if kv_cache_dtype is not None:
        engine_args = {**(engine_args or {}), "kv_cache_dtype": kv_cache_dtype}
    ceilings = measure_ceilings()
    prompts, output_lens = make_workload(num_requests)
    path = model_checkpoint()
    ours = run_minivllm(path, prompts, output_lens, profile_gpu=profile_gpu, **(engine_args or {}))
    # Both runs have the same schedule (same lengths, no prefix hits), so the second run's
    # trace gives the floor of each.
    sol = speed_of_light(ours.pop("_trace"), ours.pop("_config"), ours.pop("_params"), ceilings,
                         weight_bytes=ours.pop("_weight_bytes"), kv_dtype_bytes=ours.pop("_kv_dtype_bytes"))
    ours["speed_of_light"] = sol
    for run in ("first_run", "second_run"):
        ours[run]["percent_of_speed_of_light"] = 100 * sol["floor_seconds"] / ours[run]["seconds"]
    ours["percent_of_speed_of_light"] = ours["first_run"]["percent_of_speed_of_light"]
    baseline = run_transformers(path, prompts, output_lens) if with_transformers else None
    report = {
        "workload": {"requests": num_requests, "prompt_len": [100, 1024], "output_len": [100, 1024],
                     "token_ids": [0, 10000], "seed": 0, "temperature": 0.6, "ignore_eos": True,
                     "model": "random weights, Qwen3-0.6B shapes, bfloat16", "engine": "LLM(path, max_model_len=4096)",
                     "engine_args": engine_args or {},
                     "total_prompt_tokens": sum(map(len, prompts)), "total_output_tokens": sum(output_lens)},
        "ceilings": ceilings,
        "minivllm": ours,
        "transformers": baseline,
        "torch": torch.__version__,
    }
    if baseline and "output_tokens_per_s" in baseline.get("padded_generate", {}):
        report["speedup_vs_padded_generate"] = ours["output_tokens_per_s"] / baseline["padded_generate"]["output_tokens_per_s"]
    if baseline and "output_tokens_per_s" in baseline.get("generate_batch", {}):
        report["speedup_vs_generate_batch"] = ours["output_tokens_per_s"] / baseline["generate_batch"]["output_tokens_per_s"]
    return save_report(report, out_dir, report_name("throughput", ours["kv_cache_dtype"],
                                                    (engine_args or {}).get("quantization")))
