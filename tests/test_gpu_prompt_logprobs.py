"""Prompt logprobs on a CUDA GPU: with CUDA graphs, asynchronous scheduling (for real: the
host works a step ahead) and chunked prefill, the scores are transformers' full forward's;
and a long prompt over Qwen3's vocabulary is scored a slice of logits at a time, so its
memory does not grow with the prompt.

Marked gpu: `make test` deselects them on the CPU; scripts/gpu_check.sh runs them.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.engine import prompt_logprobs
from minivllm.llm import BUNDLED_MODEL
from minivllm.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu
TOLERANCE = 2e-3  # float32 on the GPU: the engine's kernels and cuBLAS sum in other orders than transformers


def check(output, ref: torch.Tensor, k: int) -> None:
    ids = output.prompt_token_ids
    assert len(output.prompt_logprobs) == len(ids) and output.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entry, row, token = output.prompt_logprobs[p], ref[p - 1], ids[p]
        chosen = entry[token].logprob
        assert chosen == pytest.approx(row[token].item(), abs=TOLERANCE), p
        # The rank up to near-ties (tokens within the tolerance may be ordered either way).
        assert int((row > chosen + TOLERANCE).sum()) + 1 <= entry[token].rank <= int((row > chosen - TOLERANCE).sum()) + 1
        top = sorted((lp.logprob for lp in entry.values() if lp.rank <= k), reverse=True)
        assert top == pytest.approx(row.topk(k).values.tolist(), abs=TOLERANCE), p


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_match_transformers_on_the_gpu(async_scheduling):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).cuda().eval()
    llm = LLM(dtype="float32", gpu_memory_utilization=0.2, block_size=16, max_num_batched_tokens=96,
              async_scheduling=async_scheduling)
    assert llm.engine.runner.graphs
    tokenizer = llm.get_tokenizer()
    texts = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
             "in want of a wife. " * 12, "ROMEO:", "HAMLET:\nTo be, or not to be, that is the question:\n" * 4]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert max(map(len, prompts)) > 3 * 96  # scored over several chunks
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=5),
                           use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float().log_softmax(-1)
        check(output, ref, 5)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    llm.shutdown()


def test_a_long_prompt_over_a_large_vocabulary_costs_a_slice_of_logits(tmp_path):
    """Qwen3's vocabulary (151,936 tokens) and a 4,000-token prompt in one step: all its
    logits at once would be 2.4 GB in float32 (and the log-softmax as much again); the slices
    keep the step's extra peak memory far below one such copy."""
    vocab = 151_936
    path = make_tiny_checkpoint(tmp_path, seed=2, vocab_size=vocab, max_position_embeddings=8192)
    llm = LLM(str(path), dtype="float32", gpu_memory_utilization=0.3, max_num_batched_tokens=4096,
              max_model_len=8192)
    prompt = torch.randint(0, vocab, (4000,), generator=torch.Generator().manual_seed(3)).tolist()

    def peak_extra(params) -> tuple[int, object]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        [out] = llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, out

    plain, _ = peak_extra(SamplingParams(temperature=0, max_tokens=1))
    scored, out = peak_extra(SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20))
    full = len(prompt) * vocab * 4
    rows = prompt_logprobs.PROMPT_LOGITS_ELEMENTS // vocab
    print(f"extra peak: {plain / 2**20:.0f} MiB plain, {scored / 2**20:.0f} MiB scoring "
          f"({rows} rows a slice; all the logits at once: {full / 2**20:.0f} MiB)")
    assert scored - plain < full / 4
    # And the scores are right: the engine's own model, every position's logits at once.
    runner = llm.engine.runner
    from minivllm.context import reset_context, set_context

    ids = torch.tensor(prompt, device="cuda")
    set_context(is_prefill=True, cu_seqlens_q=torch.tensor([0, len(prompt)], dtype=torch.int32, device="cuda"))
    try:
        with torch.inference_mode():
            hidden = runner.model(ids, torch.arange(len(prompt), device="cuda"))
            positions = torch.arange(0, len(prompt) - 1, 97, device="cuda")
            ref = runner.model.compute_logits(hidden[positions], all_tokens=True).float().log_softmax(-1)
    finally:
        reset_context()
    for row, p in zip(ref, positions.tolist()):
        token = prompt[p + 1]
        assert out.prompt_logprobs[p + 1][token].logprob == pytest.approx(row[token].item(), abs=TOLERANCE), p
        assert len(out.prompt_logprobs[p + 1]) in (20, 21)
    llm.shutdown()
