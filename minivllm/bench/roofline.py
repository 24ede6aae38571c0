"""The two ceilings of a GPU, measured in the same run as the benchmark they judge, and
what every benchmark shares: its timers and where its report goes.

Copy bandwidth: a large device-to-device copy, counting bytes read plus bytes written.
Matmul rate: a large bf16 matrix product on random data (zeros run faster than real data).
"""
import gc
import json
import time
from pathlib import Path

import torch

QWEN3_0_6B = dict(  # Qwen3-0.6B's exact shapes
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a model's weights are stored in, each parameter at its own dtype's size: a
    quantized linear layer's at one byte per weight (e4m3) plus its float32 scales, the
    rest at the model's dtype. What a step reads of them, at least once, from memory."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def time_cuda(fn, warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds of fn() on the GPU, timed with CUDA events after a warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def time_cuda_graph(fn, calls: int = 20, repeat: int = 10) -> float:
    """Median seconds per fn() with launch overhead taken out: ``calls`` back-to-back calls
    are captured in one CUDA graph and replayed. For kernels of a few microseconds, which a
    Python launch (~10 us) would otherwise hide; inside the engine's decode graph they run
    back to back in just this way."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_cuda(graph.replay, warmup=2, repeat=repeat) / calls


def measure_ceilings(device: str = "cuda") -> dict:
    n = 2**30  # 1 GiB of bf16 values each way: far beyond the 60 MB L2
    src = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * src.element_size() / t
    del src, dst
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = time_cuda(lambda: a @ b)
    flops = 2 * 8192**3 / t
    return {"copy_bandwidth_bytes_per_s": bandwidth, "bf16_matmul_flops_per_s": flops,
            "device": torch.cuda.get_device_name(device)}


def timed(fn) -> tuple[object, float]:
    """(fn(), its wall-clock seconds), the GPU (if any) synchronised before and after: for a
    whole run through the engine, host work included."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def release_memory() -> None:
    """Give back what the last engine or model held (the caller drops its references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def report_name(bench: str, kv_cache_dtype: str | None, quantization: str | None) -> str:
    """A benchmark's file for the formats it ran with: ``bench``.json in the model's dtype,
    with _kv_<dtype> for a float8 KV cache and _w_<method> for quantized weights."""
    kv = "" if kv_cache_dtype in (None, "auto") else f"_kv_{kv_cache_dtype}"
    weights = "" if quantization in (None, "none", "auto") else f"_w_{quantization}"
    return f"{bench}{kv}{weights}.json"


def save_report(report: dict, out_dir: str, name: str) -> dict:
    """Write ``report`` as ``out_dir/name`` (JSON) and return it."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / name).write_text(json.dumps(report, indent=2))
    return report
