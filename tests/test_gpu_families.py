"""Every dense family on a CUDA GPU (Triton kernels, CUDA graphs) against transformers.

float32: the kernels use true float32 dot products, so greedy decoding matches token for
token, as in test_gpu_engine. Gemma 3's sliding-window layers run in the Triton kernels
(window 32 here, prompts up to 300 tokens, chunked prefill so chunks start inside and past
the window). bfloat16: the first token's top-5 log-probabilities agree within 0.1, as in
test_gpu_engine's bf16 check.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

FAMILIES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(),
    "gemma3": dict(sliding_window=32, final_logit_softcapping=4.0),
}


def prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(1, 512, (int(n),), generator=g).tolist() for n in (5, 31, 33, 100, 300, 64, 2, 180)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_greedy_identical(tmp_path, family):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_tiny_checkpoint(tmp_path, family=family, seed=21, max_position_embeddings=1024, **FAMILIES[family])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    llm = LLM(str(path), dtype="float32", gpu_memory_utilization=0.3, block_size=16, max_num_batched_tokens=128)
    assert llm.engine.runner.graphs, "decode should run in CUDA graphs"
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts(), outputs):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), family


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_top_logprobs_close(tmp_path, family):
    path = make_tiny_checkpoint(tmp_path, family=family, seed=22, dtype=torch.bfloat16,
                                max_position_embeddings=1024, **FAMILIES[family])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.3)
    prompt = prompts()[4]
    # Our top 20 must hold their top 5: near-ties may swap places within bf16 rounding.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float().log_softmax(-1)
    top = ref.topk(5)
    ours = out.outputs[0].logprobs[0]
    for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
        assert tid in ours and abs(ours[tid].logprob - lp) < 0.1, family
