"""Llama (with Llama 3.1 RoPE scaling) and Qwen2 (q/k/v biases) against transformers on
tiny random checkpoints, float32, CPU: logits and greedy tokens through the full engine.

Tolerance as in test_parity_qwen3: the same float32 math in another order, 1e-4 on O(1)
logits.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context
from minivllm.loader import load_model
from minivllm.testing import make_tiny_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    # Prompts run well past original_max_position_embeddings, where the scaling acts.
    "llama": dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
    "qwen2": dict(),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=11,
                                **FAMILIES[request.param])
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_detected_features(family):
    name, path, _ = family
    config = load_model(path).config
    assert config.qk_norm is False
    assert config.attention_bias == (name == "qwen2") and config.o_proj_bias is False
    assert (config.rope_scaling or {}).get("rope_type") == ("llama3" if name == "llama" else None)
    assert config.tie_word_embeddings == (name == "qwen2")


@pytest.mark.parametrize("length", [5, 300])
def test_logits_match(family, length):
    _, path, hf = family
    ours = load_model(path)
    ids = torch.randint(0, 512, (length,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(length)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_engine_greedy_matches(family):
    """Paged, batched, chunked (budget 64) and prefix-cached (shared prefix): identical."""
    _, path, hf = family
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (1, 30, 150, 7)]
    prompts += [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 90, 200)]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=200, block_size=8, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert sum(o.num_cached_tokens for o in outputs) > 0
