#!/usr/bin/env python
"""Would the fp8 KV cache's attention lose accuracy if its two products ran on fp8 tensor
cores? Measured before writing the kernel (chapter 20).

The fp8 decode attention today converts each fp8 tile of keys and values to float16 and
multiplies in float16. Hopper's fp8 MMA would take both operands in e4m3: the queries
rounded to e4m3 for q.k (one scale per query row and head, from its largest entry), and the
softmax weights rounded to e4m3 for p.v (scaled by 448 first, so that weights down to about
4e-6 keep a mantissa; the row sums that normalize the output stay in float32, from the
unrounded weights, as a flash-attention kernel keeps them). This script emulates those
roundings in the torch attention (the CPU path, which attends every position over its fp8
cache) and measures what ``minivllm bench quantization`` measures for the cache itself:

- the bundled model's perplexity on held-out text, against bf16;
- teacher-forced top-1 agreement with bf16 on random-weight checkpoints of every family.

    python scripts/fp8_attention_accuracy.py [--out benchmarks]
"""
import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch

from minivllm import LLM, SamplingParams
from minivllm.bench import quantization
from minivllm.bench.roofline import save_report
from minivllm.ops import attention
from minivllm.testing import FAMILIES, make_tiny_checkpoint

E4M3, E4M3_MAX = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max

# Each configuration: the engine's options, and which products are rounded to e4m3.
CONFIGS = {
    "bf16": ({}, None),
    "fp8 KV cache": ({"kv_cache_dtype": "fp8"}, None),
    "fp8 KV cache, q.k in fp8": ({"kv_cache_dtype": "fp8"}, {"round_p": False}),
    "fp8 KV cache, q.k and p.v in fp8": ({"kv_cache_dtype": "fp8"}, {"round_p": True}),
}


def to_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x rounded to e4m3 after dividing by scale, and back (float32)."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale


def fp8_products_attention(q, k, v, scale, sliding_window=None, round_p=True):
    """``ops.attention.causal_attention`` with the queries (and, with ``round_p``, the softmax
    weights) rounded to e4m3 as fp8 MMAs would take them. q: [q_len, heads, dim]; k, v:
    [kv_len, kv_heads, dim], already as the fp8 cache holds them."""
    q_len, heads, _ = q.shape
    kv_len, kv_heads, _ = k.shape
    q = q.float()
    q = to_e4m3(q, q.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX)
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    key_pos = torch.arange(kv_len)[None, :]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    p = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    row_sums = p.sum(dim=-1, keepdim=True)  # from the unrounded weights, in float32
    if round_p:
        p = to_e4m3(p, 1 / E4M3_MAX)
    out = torch.einsum("hqk,khd->qhd", p / row_sums, v)
    return out.to(v.dtype if v.dtype != torch.float32 else torch.float32)


@contextlib.contextmanager
def products(options: dict | None):
    """Within the block the torch attention rounds as ``options`` says (None: as it is)."""
    if options is None:
        yield
        return
    original = attention.causal_attention

    def emulated(q, k, v, scale, sliding_window=None):
        return fp8_products_attention(q, k, v, scale, sliding_window, **options).to(q.dtype)

    attention.causal_attention = emulated
    try:
        yield
    finally:
        attention.causal_attention = original


def bundled_perplexity() -> dict:
    rows, prompts = {}, None
    for name, (options, rounding) in CONFIGS.items():
        llm = LLM(dtype="bfloat16", device="cpu", num_kv_blocks=256, **options)
        if prompts is None:
            ids = llm.get_tokenizer().encode(quantization.HELDOUT.read_text(), verbose=False)
            prompts = quantization.windows(ids, quantization.WINDOW)
        with products(rounding):
            scored = [row for rows_ in quantization.scored_positions(llm, prompts) for row in rows_]
        nll = -sum(lp for lp, _ in scored) / len(scored)
        rows[name] = {"perplexity": float(torch.tensor(nll).exp()), "tokens": len(scored)}
        llm.shutdown()
    base = rows["bf16"]["perplexity"]
    for row in rows.values():
        row["vs_bf16_percent"] = 100 * (row["perplexity"] / base - 1)
    return rows


def family_agreement(family: str, workdir: Path) -> dict:
    """Top-1 agreement with bf16 and KL(bf16 || this), teacher-forced on random prompts."""
    path = make_tiny_checkpoint(workdir / family, family=family, seed=20, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(20)
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0)
    logprobs, prompts = {}, None
    for name, (options, rounding) in CONFIGS.items():
        llm = LLM(str(path), dtype="bfloat16", device="cpu", num_kv_blocks=64, max_logprobs=-1, **options)
        vocab = llm.engine.runner.model_config.vocab_size
        if prompts is None:
            prompts = torch.randint(1, vocab, (quantization.FAMILY_SEQUENCES, quantization.FAMILY_TOKENS),
                                    generator=generator).tolist()
        with products(rounding):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        logprobs[name] = torch.stack([torch.tensor([entry[t].logprob for t in range(vocab)])
                                      for out in outputs for entry in out.prompt_logprobs[1:]])
        llm.shutdown()
    reference = logprobs["bf16"]
    top = reference.argmax(dim=1, keepdim=True)
    return {name: {"top1_agreement": float((lp.argmax(dim=1, keepdim=True) == top).float().mean()),
                   "mean_kl": float((reference.exp() * (reference - lp)).sum(dim=1).mean()),
                   "positions": lp.shape[0]}
            for name, lp in logprobs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks")
    args = parser.parse_args()
    start = time.perf_counter()
    report = {"what": "accuracy of fp8 attention products (emulated on the CPU) against bf16 (chapter 20)",
              "device": "cpu", "torch": torch.__version__, "heldout": quantization.HELDOUT.name,
              "window_tokens": quantization.WINDOW, "bundled_model": bundled_perplexity()}
    with tempfile.TemporaryDirectory() as workdir:
        report["families"] = {family: family_agreement(family, Path(workdir)) for family in FAMILIES}
    report["seconds"] = time.perf_counter() - start
    save_report(report, args.out, "fp8_attention_accuracy.json")
    for name, row in report["bundled_model"].items():
        print(f"{name:34s} perplexity {row['perplexity']:7.3f} ({row['vs_bf16_percent']:+.2f}%)  top-1 as bf16's, "
              f"lowest family: {min(f[name]['top1_agreement'] for f in report['families'].values()):.1%}")


if __name__ == "__main__":
    main()
