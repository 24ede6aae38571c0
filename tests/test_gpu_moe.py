"""Mixture of experts on a CUDA GPU: the fused kernels at Qwen3-30B-A3B's layer shapes in
bfloat16, and Qwen3-MoE through the engine (CUDA graphs included) against transformers.

Marked gpu: `make test` deselects them on the CPU; scripts/gpu_check.sh runs them.

Tolerance of the kernel test: the reference runs in float32 on the same bf16 inputs; the
kernels accumulate in float32 but round the [T*K, I] intermediate and each expert's
weighted output to bf16 (relative 2^-8 ~ 4e-3) before the combine adds K of them, so
outputs of O(1) agree within a few bf16 ulps: atol 3e-2, rtol 3e-2.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.ops.moe import experts_reference
from minivllm.testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B


@pytest.mark.parametrize("tokens", [1, 8, 100, 2048])
def test_fused_moe_real_shapes_bf16(tokens):
    from minivllm.ops.moe import fused_experts_triton as fused_moe

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=dt)
    w_gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev) * HIDDEN**-0.5).to(dt)
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, device=dev) * INTER**-0.5).to(dt)
    logits = torch.randn(tokens, EXPERTS, device=dev)
    logits[:, :4] = float("-inf")  # four experts get no token
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    out = fused_moe(x, w_gate_up, w_down, weights.to(dt), ids)
    ref = experts_reference(x.float(), w_gate_up.float(), w_down.float(), weights.to(dt).float(), ids)
    assert out.dtype == dt and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in torch.randint(2, 300, (24,), generator=g)]


def test_float32_greedy_identical_to_transformers(tmp_path, prompts, monkeypatch):
    """float32 (true float32 dot products in the kernels): the fused experts in CUDA graphs
    and the reference loop (eager) both give transformers' greedy tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_tiny_checkpoint(tmp_path, family="qwen3_moe", seed=5, max_position_embeddings=1024)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for backend, eager in (("fused", False), ("reference", True)):
        monkeypatch.setenv("MINIVLLM_MOE_BACKEND", backend)
        llm = LLM(str(path), dtype="float32", enforce_eager=eager, gpu_memory_utilization=0.3,
                  max_num_batched_tokens=512)
        assert bool(llm.engine.runner.graphs) != eager
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert runs["fused"][i] == ref and runs["reference"][i] == ref


def test_bfloat16_logits_close_to_transformers(tmp_path):
    """bfloat16 at wider tiny shapes (64 experts, top-8): first-token log-probs within 0.1 of
    transformers' bf16, the same top token."""
    path = make_tiny_checkpoint(tmp_path, family="qwen3_moe", seed=6, dtype=torch.bfloat16, hidden_size=256,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_hidden_layers=4,
                                num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(str(path), dtype="bfloat16", gpu_memory_utilization=0.3)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (200,), generator=g).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float().log_softmax(-1)
    top = ref.topk(5)
    ours = out.outputs[0].logprobs[0]
    assert out.outputs[0].token_ids[0] == int(top.indices[0])
    for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
        assert tid in ours and abs(ours[tid].logprob - lp) < 0.1
