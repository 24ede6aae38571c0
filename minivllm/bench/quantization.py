"""What the FP8 formats cost in accuracy, measured (chapter 20).

Four engines on the same weights: bf16 (the reference), an fp8 KV cache, fp8 weights (W8A8),
and both. Two measurements:

- the bundled model's **perplexity** on held-out text of its corpus (the end of the last
  novel and of the last plays, which training never saw: ``minivllm/assets/heldout.txt``),
  teacher-forced through ``prompt_logprobs``, in windows of ``WINDOW`` tokens;
- on random-weight checkpoints of the seven families, **teacher-forced top-1 agreement**
  with the bf16 engine (the share of positions whose most likely next token is the same) and
  the largest change in the log-probability of the bf16 engine's top token.

It runs on the CPU by default: the torch paths store every key and value into the cache
and read them back, so every position attends over fp8 keys as a decode step does (a GPU
prefill reads its own keys from registers, before they are rounded). The GPU kernels are
checked against the same torch paths by the kernel tests.

    minivllm bench quantization [--out benchmarks]
"""
import time
from pathlib import Path

import torch

from minivllm.bench.roofline import save_report

HELDOUT = Path(__file__).resolve().parents[1] / "assets" / "heldout.txt"
WINDOW = 512  # tokens per teacher-forced window of the held-out text
CONFIGS = {
    "bf16": {},
    "fp8 KV cache": {"kv_cache_dtype": "fp8"},
    "fp8 weights": {"quantization": "fp8"},
    "fp8 KV cache and weights": {"kv_cache_dtype": "fp8", "quantization": "fp8"},
}
FAMILY_SEQUENCES, FAMILY_TOKENS = 4, 96  # random prompts per family, tokens each


def scored_positions(llm, prompts: list[list[int]]) -> list[list[tuple[float, int]]]:
    """For each prompt, each position after the first: (log-probability of the prompt's own
    next token, the engine's most likely token there)."""
    from minivllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scored = []
    for prompt, output in zip(prompts, outputs):
        rows = []
        for token, entry in zip(prompt[1:], output.prompt_logprobs[1:]):
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            rows.append((entry[token].logprob, top))
        scored.append(rows)
    return scored


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    return [token_ids[i : i + size] for i in range(0, len(token_ids) - 1, size) if len(token_ids[i : i + size]) > 1]


def bundled_perplexity(device: str) -> dict:
    """Perplexity of the bundled model on the held-out text under each configuration."""
    from minivllm import LLM

    rows = {}
    prompts = None
    for name, options in CONFIGS.items():
        llm = LLM(dtype="bfloat16", device=device, num_kv_blocks=256, **options)
        if prompts is None:
            ids = llm.get_tokenizer().encode(HELDOUT.read_text(), verbose=False)  # longer than the model: windows below
            prompts = windows(ids, WINDOW)
        start = time.perf_counter()
        scored = [row for rows_ in scored_positions(llm, prompts) for row in rows_]
        nll = -sum(lp for lp, _ in scored) / len(scored)
        rows[name] = {"perplexity": float(torch.tensor(nll).exp()), "nll_per_token": nll, "tokens": len(scored),
                      "seconds": time.perf_counter() - start}
    base = rows["bf16"]["perplexity"]
    for row in rows.values():
        row["vs_bf16_percent"] = 100 * (row["perplexity"] / base - 1)
    return rows


def family_agreement(family: str, workdir: Path, device: str) -> dict:
    """Top-1 agreement with bf16 and the largest log-probability change of bf16's top token,
    teacher-forced on random prompts, for a random-weight checkpoint of ``family``."""
    from minivllm import LLM, SamplingParams
    from minivllm.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(workdir / family, family=family, seed=20, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(20)
    llms = {name: LLM(str(path), dtype="bfloat16", device=device, num_kv_blocks=64, max_logprobs=-1, **options)
            for name, options in CONFIGS.items()}
    vocab = llms["bf16"].engine.runner.model_config.vocab_size
    prompts = torch.randint(1, vocab, (FAMILY_SEQUENCES, FAMILY_TOKENS), generator=generator).tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0)  # the whole vocabulary
    logprobs = {}
    for name, llm in llms.items():
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        # [positions, vocab]: the whole next-token distribution at each position but the first.
        logprobs[name] = torch.stack([torch.tensor([entry[t].logprob for t in range(vocab)])
                                      for out in outputs for entry in out.prompt_logprobs[1:]])
    reference = logprobs["bf16"]
    top = reference.argmax(dim=1, keepdim=True)
    rows = {}
    for name, lp in logprobs.items():
        rows[name] = {"top1_agreement": float((lp.argmax(dim=1, keepdim=True) == top).float().mean()),
                      "max_top_logprob_change": float((lp.gather(1, top) - reference.gather(1, top)).abs().max()),
                      # KL(bf16 || this), nats per position: how far the whole distribution moved.
                      "mean_kl": float((reference.exp() * (reference - lp)).sum(dim=1).mean()),
                      "positions": lp.shape[0]}
    return rows


def main(out_dir: str = "benchmarks", device: str = "cpu") -> dict:
    import tempfile

    from minivllm.testing import FAMILIES

    start = time.perf_counter()
    report = {"what": "accuracy of the fp8 KV cache and fp8 weights against bf16 (chapter 20)",
              "device": device, "torch": torch.__version__, "heldout": HELDOUT.name, "window_tokens": WINDOW,
              "bundled_model": bundled_perplexity(device)}
    with tempfile.TemporaryDirectory() as workdir:
        report["families"] = {family: family_agreement(family, Path(workdir), device) for family in FAMILIES}
    report["seconds"] = time.perf_counter() - start
    return save_report(report, out_dir, "quantization_accuracy.json")
