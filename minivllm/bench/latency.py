"""Latency: batch-1 decode speed and time to first token, with and without CUDA graphs.

Batch-1 decode is the purest memory-bound case: each token must read every weight once,
so its floor is weight bytes / copy bandwidth (plus the K/V of its short context).
"""
from pathlib import Path

import torch

from minivllm.bench.roofline import measure_ceilings, release_memory, report_name, save_report, timed
from minivllm.bench.throughput import model_checkpoint


def _timed_generate(llm, prompt, params) -> float:
    return timed(lambda: llm.generate([prompt], params, use_tqdm=False))[1]


def measure(path: Path, enforce_eager: bool, decode_tokens: int = 256, kv_cache_dtype: str = "auto",
            quantization: str | None = None) -> dict:
    from minivllm import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", enforce_eager=enforce_eager, gpu_memory_utilization=0.5,
              max_num_seqs=8, max_model_len=8192, kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, llm.engine.runner.model_config.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    _timed_generate(llm, rand(128), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
    ttft = {}
    for n in (128, 1024, 4096):
        prompt = rand(n)
        _timed_generate(llm, prompt, one)  # warm the prefill kernels for this length
        ttft[str(n)] = min(_timed_generate(llm, rand(n), one) for _ in range(3))
    # The best of three fresh prompts, as for the time to first token.
    decode = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    total = min(_timed_generate(llm, rand(128), decode) for _ in range(3))
    first = ttft["128"]
    tpot = (total - first) / (decode_tokens - 1)
    params = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    del llm
    release_memory()
    return {"enforce_eager": enforce_eager, "ttft_seconds": ttft, "decode_tokens_per_s": 1 / tpot,
            "time_per_output_token_s": tpot, "weight_bytes": params}


def main(out_dir: str = "benchmarks", kv_cache_dtype: str = "auto", quantization: str | None = None) -> dict:
    """``kv_cache_dtype`` and ``quantization`` (EngineConfig's) also name the report
    (``report_name``): latency.json in the model's dtype, latency_kv_fp8.json for a float8
    cache, latency_w_fp8.json for fp8 weights, latency_kv_fp8_w_fp8.json for both. The
    floor is the weights read once, at the bytes they are stored in."""
    ceilings = measure_ceilings()
    path = model_checkpoint()
    graphs = measure(path, enforce_eager=False, kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    eager = measure(path, enforce_eager=True, kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    floor = graphs["weight_bytes"] / ceilings["copy_bandwidth_bytes_per_s"]
    report = {
        "model": "random weights, Qwen3-0.6B shapes, bfloat16, batch 1",
        "kv_cache_dtype": kv_cache_dtype,
        "quantization": quantization,
        "ceilings": ceilings,
        "cuda_graphs": graphs,
        "eager": eager,
        "decode_floor_s_per_token": floor,
        "percent_of_speed_of_light_with_graphs": 100 * floor / graphs["time_per_output_token_s"],
        "graph_speedup": eager["time_per_output_token_s"] / graphs["time_per_output_token_s"],
    }
    return save_report(report, out_dir, report_name("latency", kv_cache_dtype, quantization))
