#!/usr/bin/env python
"""Where the fp8-weight error of the random-weight families comes from (chapter 20).

``minivllm bench quantization`` finds fp8 weights agreeing with bf16 on 80-90% of top-1
tokens for the dense random-weight families, below the 95% asked for. This script asks two
questions of each family, teacher-forced on the same random prompts as that benchmark:

1. How fine is the measure? float32 against bf16 on the same checkpoint (the rounding of
   bf16 alone), and the bf16 engine's own top-1 margins: a random-weight model's next-token
   distribution is nearly flat, so a small change in the logits flips a near-tie.
2. Which tensor moves the logits? fp8 weights as the engine makes them (the Gated DeltaNet
   layers kept in bf16), on every projection, on one kind of projection at a time (the
   others kept in bf16), and on every projection with the activations left unquantized
   (weights alone, W8A16).

    python scripts/fp8_error_sources.py [family ...]   # writes benchmarks/quantization_error_sources.json

It runs on the CPU (the float32 reference of the W8A8 matmul, as the benchmark does).
"""
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import minivllm.layers.quantization as quantization
import minivllm.ops.quant as quant
from minivllm import LLM, SamplingParams
from minivllm.bench.quantization import FAMILY_SEQUENCES, FAMILY_TOKENS
from minivllm.layers.linear import linear_layers
from minivllm.testing import FAMILIES, make_tiny_checkpoint

MARGIN = 0.05  # nats: a top-1 lead smaller than this is a near-tie


def next_token_logprobs(path: Path, prompts: list[list[int]], **options) -> torch.Tensor:
    """[positions, vocab]: the whole next-token distribution at each position but the first."""
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_logprobs=-1, **{"dtype": "bfloat16", **options})
    vocab = llm.engine.runner.model_config.vocab_size
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0), use_tqdm=False)
    llm.engine.shutdown()
    return torch.stack([torch.tensor([entry[t].logprob for t in range(vocab)])
                        for out in outputs for entry in out.prompt_logprobs[1:]])


def projection_kinds(path: Path) -> tuple[list[str], int]:
    """The names of the linear layers fp8 weights quantize (qkv_proj, down_proj, ...), and the
    vocabulary's size."""
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, dtype="bfloat16")
    model = llm.engine.runner.model
    linears = set(linear_layers(model))
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module in linears}
    vocab = llm.engine.runner.model_config.vocab_size
    llm.engine.shutdown()
    return sorted(n for n in names if n not in quantization.NOT_QUANTIZED), vocab


def activations_unquantized(x, weight, weight_scale, bias=None):
    """``ops.quant.fp8_linear_reference`` without rounding x to fp8: the weights' error alone."""
    y = x.float() @ quant.dequantize_per_row(weight, weight_scale).t()
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def family_sources(family: str, workdir: Path) -> dict:
    path = make_tiny_checkpoint(workdir / family, family=family, seed=20, dtype=torch.bfloat16)
    kinds, vocab = projection_kinds(path)
    prompts = torch.randint(1, vocab, (FAMILY_SEQUENCES, FAMILY_TOKENS),
                            generator=torch.Generator().manual_seed(20)).tolist()
    reference = next_token_logprobs(path, prompts)
    top2 = reference.topk(2, dim=1)
    top, margin = top2.indices[:, 0], top2.values[:, 0] - top2.values[:, 1]

    def against_bf16(logprobs: torch.Tensor) -> dict:
        agree = logprobs.argmax(dim=1) == top
        return {"top1_agreement": float(agree.float().mean()),
                f"top1_agreement_where_margin_over_{MARGIN}": float(agree[margin > MARGIN].float().mean()),
                "mean_kl": float((reference.exp() * (reference - logprobs)).sum(dim=1).mean()),
                "median_margin_of_disagreements": float(margin[~agree].median()) if (~agree).any() else None}

    row = {"positions": int(reference.shape[0]), "median_top1_margin_nats": float(margin.median()),
           f"positions_with_margin_over_{MARGIN}": int((margin > MARGIN).sum()),
           "float32": against_bf16(next_token_logprobs(path, prompts, dtype="float32")),
           "fp8 weights": against_bf16(next_token_logprobs(path, prompts, quantization="fp8"))}
    # The rest with every projection fp8, the Gated DeltaNet layers' too (the engine keeps
    # those in bf16: quantization.NOT_QUANTIZED_MODULES).
    kept, kept_modules = quantization.NOT_QUANTIZED, quantization.NOT_QUANTIZED_MODULES
    reference_matmul = quant.fp8_linear_reference
    quantization.NOT_QUANTIZED_MODULES = ()
    try:
        row["fp8 every projection"] = against_bf16(next_token_logprobs(path, prompts, quantization="fp8"))
        for kind in kinds:
            quantization.NOT_QUANTIZED = kept + tuple(k for k in kinds if k != kind)
            row[f"fp8 {kind} only"] = against_bf16(next_token_logprobs(path, prompts, quantization="fp8"))
        quantization.NOT_QUANTIZED = kept
        quant.fp8_linear_reference = activations_unquantized
        row["fp8 every projection, activations unquantized"] = against_bf16(
            next_token_logprobs(path, prompts, quantization="fp8"))
    finally:
        quantization.NOT_QUANTIZED, quantization.NOT_QUANTIZED_MODULES = kept, kept_modules
        quant.fp8_linear_reference = reference_matmul
    return row


def main(families: list[str]) -> dict:
    start = time.perf_counter()
    report = {"what": "where the fp8-weight error of the random-weight families comes from (chapter 20)",
              "device": "cpu", "torch": torch.__version__, "margin_nats": MARGIN, "families": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for family in families:
            report["families"][family] = family_sources(family, Path(workdir))
            print(family, json.dumps(report["families"][family]), flush=True)
    report["seconds"] = time.perf_counter() - start
    out = Path(__file__).resolve().parents[1] / "benchmarks" / "quantization_error_sources.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:] or list(FAMILIES))
