"""Tensor parallelism: what the communication costs, and what two GPUs buy.

- ``all_reduce_cost``: the time of one all-reduce against its size, between 2 processes
  (gloo between CPU processes, NCCL between GPUs). A decode step of a model with L layers
  does 2L + 1 all-reduces of [tokens, hidden] (after attention, after the feed-forward, and
  the embedding) and one all-gather of the logits.
- ``forward_profile``: one forward pass on every rank with each collective timed: where
  they go and what share of the step they take.
- ``main`` (``minivllm bench tp``, GPUs only): throughput and batch-1 decode latency at
  tensor_parallel_size 1 and 2 on a random-weight model with Qwen3-8B's layer shapes and
  fewer layers. Splitting halves each GPU's weight reads, the floor of a memory-bound
  decode step, and adds the all-reduces.
"""
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minivllm.bench.roofline import release_memory, save_report, timed
from minivllm.distributed import parallel_state

QWEN3_8B_LAYERS = dict(  # Qwen3-8B's shapes, with num_hidden_layers set by the caller
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_cost(sizes: list[int], hidden: int, dtype: torch.dtype = torch.float32, repeats: int = 20) -> list[dict]:
    """Run on every rank (``run_on_ranks``): median seconds of an all-reduce of a
    [tokens, hidden] tensor, for each number of tokens in ``sizes``."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for tokens in sizes:
        x = torch.randn(tokens, hidden, dtype=dtype, device=device)
        for _ in range(3):  # warm-up: connections, buffers
            dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            dist.all_reduce(x)
            _sync(device)
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        nbytes = x.numel() * x.element_size()
        rows.append({"tokens": tokens, "bytes": nbytes, "seconds": seconds,
                     # A ring all-reduce moves 2 (n - 1) / n of the tensor through each link.
                     "bus_bytes_per_s": 2 * (dist.get_world_size() - 1) / dist.get_world_size() * nbytes / seconds})
    return rows


def forward_profile(path: str, num_tokens: int, repeats: int = 5) -> dict:
    """Run on every rank (or in one process): time one forward pass over ``num_tokens``
    tokens, and every collective inside it (op, shape, seconds), in call order."""
    from minivllm.context import reset_context
    from minivllm.loader import load_model

    model = load_model(path)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(num_tokens)
    calls: list[tuple[str, tuple, float]] = []
    original = {"all_reduce": dist.all_reduce, "all_gather": dist.all_gather}

    def recorded(name):
        def op(tensor_or_list, *args, **kwargs):
            start = time.perf_counter()
            result = original[name](tensor_or_list, *args, **kwargs)
            shape = tuple((args[0] if name == "all_gather" else tensor_or_list).shape)
            calls.append((name, shape, time.perf_counter() - start))
            return result
        return op

    best = None
    # This process is a throwaway rank (or a notebook's single process): patching the
    # collectives here to time them touches nothing else.
    dist.all_reduce, dist.all_gather = recorded("all_reduce"), recorded("all_gather")
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                calls.clear()
                reset_context()
                if parallel_state.get_tp_world_size() > 1:
                    dist.barrier()
                start = time.perf_counter()
                model.compute_logits(model(ids, positions))
                total = time.perf_counter() - start
                if best is None or total < best["seconds"]:
                    best = {"seconds": total, "calls": list(calls)}
    finally:
        dist.all_reduce, dist.all_gather = original["all_reduce"], original["all_gather"]
    best["communication_seconds"] = sum(s for _, _, s in best["calls"])
    best["world_size"] = parallel_state.get_tp_world_size()
    best["num_layers"] = model.config.num_hidden_layers
    return best


# -- GPUs: throughput and latency at tp=1 and tp=2 -------------------------------------------

def measure(path: Path, tp: int, num_requests: int, decode_tokens: int = 256) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.bench.throughput import make_workload

    llm = LLM(str(path), dtype="bfloat16", tensor_parallel_size=tp, max_num_seqs=256,
              max_num_batched_tokens=16384, max_model_len=4096, gpu_memory_utilization=0.85)
    try:
        warm, _ = make_workload(16, seed=12345)
        llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        # Batch-1 decode: every step reads all of this rank's weights once.
        one = [list(range(1000, 1128))]
        llm.generate(one, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(one, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([list(range(2000, 2128))], SamplingParams(temperature=0, max_tokens=decode_tokens,
                                                                 ignore_eos=True), use_tqdm=False)
        tpot = (time.perf_counter() - start - first) / (decode_tokens - 1)
        # Throughput: the standard workload's shape, fewer requests.
        prompts, output_lens = make_workload(num_requests)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
        outputs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
        return {"tensor_parallel_size": tp, "output_tokens": tokens, "seconds": seconds,
                "output_tokens_per_s": tokens / seconds, "time_per_output_token_s": tpot,
                "weight_bytes_per_gpu": weight_bytes, "kv_blocks": llm.engine.runner.num_kv_blocks}
    finally:
        llm.shutdown()
        del llm
        release_memory()


def main(out_dir: str = "benchmarks", num_layers: int = 8, num_requests: int = 256) -> dict:
    from minivllm.bench.throughput import model_checkpoint
    from minivllm.distributed.launch import run_on_ranks

    if torch.cuda.device_count() < 2:
        raise RuntimeError(f"minivllm bench tp needs 2 CUDA GPUs; this machine has {torch.cuda.device_count()}")
    shapes = {**QWEN3_8B_LAYERS, "num_hidden_layers": num_layers}
    path = model_checkpoint(f"qwen3-8b-{num_layers}-layers-random", shapes)
    runs = [measure(path, tp, num_requests) for tp in (1, 2)]
    hidden = QWEN3_8B_LAYERS["hidden_size"]
    comm = run_on_ranks(all_reduce_cost, 2, [1, 8, 64, 256, 2048, 8192], hidden, torch.bfloat16, device="cuda")[0]
    report = {
        "model": f"random weights, Qwen3-8B layer shapes, {num_layers} layers, bfloat16",
        "device": torch.cuda.get_device_name(0),
        "runs": runs,
        "throughput_speedup": runs[1]["output_tokens_per_s"] / runs[0]["output_tokens_per_s"],
        "decode_latency_speedup": runs[0]["time_per_output_token_s"] / runs[1]["time_per_output_token_s"],
        "all_reduce_bf16_nccl": comm,
        "all_reduces_per_step": 2 * num_layers + 1,
    }
    return save_report(report, out_dir, "tensor_parallel.json")
