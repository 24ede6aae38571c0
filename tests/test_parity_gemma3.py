"""Gemma 3 (text) against transformers on tiny random checkpoints, float32, CPU.

The tiny model has four layers, local (sliding window of 16) and global alternating, so
prompts much longer than the window exercise both kinds; one checkpoint softcaps its
final logits and scales the global layers' RoPE, the other does neither. Tolerance as in
test_parity_qwen3: the same float32 math in another order, 1e-4 on O(1) logits.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.context import reset_context
from minivllm.loader import load_model
from minivllm.ops.attention import causal_attention
from minivllm.testing import make_tiny_checkpoint

WINDOW = 16
VARIANTS = {
    "plain": dict(),
    "softcap": dict(final_logit_softcapping=4.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"gemma3-{request.param}"), family="gemma3", seed=11,
                                sliding_window=WINDOW, **VARIANTS[request.param])
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_config(gemma):
    name, path, _ = gemma
    config = load_model(path).config
    assert config.model_type == "gemma3_text" and config.sliding_window == WINDOW
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config.rope_local_theta == 10000.0 and config.rope_theta == 1000000.0
    assert config.final_logit_softcapping == (4.0 if name == "softcap" else None)
    assert (config.rope_scaling or {}).get("rope_type") == ("linear" if name == "softcap" else None)


@pytest.mark.parametrize("window", [1, 3, 8, 20])
def test_window_mask(window):
    """Query at position p sees keys j with p - window < j <= p, also as the tail of a longer sequence."""
    torch.manual_seed(0)
    q, k, v = torch.randn(6, 2, 4), torch.randn(10, 1, 4), torch.randn(10, 1, 4)
    out = causal_attention(q, k, v, 0.5, sliding_window=window)
    p, j = torch.arange(4, 10)[:, None], torch.arange(10)[None, :]
    scores = torch.einsum("qhd,kd->hqk", q, k[:, 0]) * 0.5
    scores = scores.masked_fill(~((j <= p) & (j > p - window)), float("-inf"))
    ref = torch.einsum("hqk,kd->qhd", scores.softmax(-1), v[:, 0])
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("length", [5, 300])
def test_logits_match(gemma, length):
    _, path, hf = gemma
    ours = load_model(path)
    ids = torch.randint(0, 512, (length,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(length)), all_tokens=True)
        ref = hf(ids[None]).logits[0]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
        if length > WINDOW:  # the window matters: without it the logits differ
            for layer in ours.model.layers:
                layer.self_attn.attn.sliding_window = None
            unwindowed = ours.compute_logits(ours(ids, torch.arange(length)), all_tokens=True)
            assert (unwindowed - ref).abs().max() > 1e-2


def test_engine_greedy_matches(gemma):
    """Paged, batched, chunked (budget 64) and prefix-cached (shared prefix), prompts past the window."""
    _, path, hf = gemma
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (1, 30, 150, 7)]
    prompts += [torch.randint(0, 512, (int(n),), generator=g).tolist() for n in (3, 90, 200)]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=200, block_size=8, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        # Gemma's pad_token_id is 0, a token random prompts contain: without an explicit
        # mask, generate would take those tokens for padding and mask them out.
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert sum(o.num_cached_tokens for o in outputs) > 0
