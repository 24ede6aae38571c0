"""The engine's own host time per step, on any machine (the CPU included).

A decode step's wall time is the GPU's work plus the host's: scheduling, flattening the
batch (``prepare``), appending the sampled tokens. The GPU has nothing queued while the host
works, so at large batch sizes this Python is a direct cost. It does not depend on the
model's size, so a tiny model on the CPU measures it: 256 sequences with prompts of
100-1024 tokens (the throughput workload's shape), decoding together.

    python scripts/profile_host.py [--num-seqs 256] [--max-tokens 48]

(On the GPU, ``minivllm bench throughput`` reports the same host time for its own run.)
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint


def main(num_seqs: int, max_tokens: int) -> None:
    torch.set_num_threads(1)
    path = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "m", dtype=torch.float32, vocab_size=512, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=num_seqs * 80, block_size=16,
              max_num_seqs=num_seqs, max_num_batched_tokens=16384, record_trace=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(100, 1025, (num_seqs,), generator=g)]
    prepare_seconds = {}
    runner, prepare = llm.engine.runner, llm.engine.runner.prepare

    def timed_prepare(batch):
        start = time.perf_counter()
        out = prepare(batch)
        prepare_seconds[llm.engine.num_steps] = time.perf_counter() - start
        return out

    runner.prepare = timed_prepare
    llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    full = [s for s in llm.engine.trace if not s.num_prefill_tokens and len(s.seqs) == num_seqs]
    if not full:
        raise SystemExit("no decode step ran all sequences at once: raise --max-tokens")
    outside = statistics.median(s.host_seconds for s in full)
    inside = statistics.median(prepare_seconds[s.step] for s in full)
    print(f"{len(full)} decode steps of {num_seqs} sequences, medians:")
    print(f"  outside the model runner (schedule, append tokens, commit blocks): {outside * 1e3:.2f} ms")
    print(f"  prepare (flatten the batch, one host-to-device copy):              {inside * 1e3:.2f} ms")
    print(f"  host time per step, the GPU idle:                                  {(outside + inside) * 1e3:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    main(args.num_seqs, args.max_tokens)
