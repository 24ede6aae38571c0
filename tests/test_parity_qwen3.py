"""Qwen3 against transformers on the same tiny random weights, float32, CPU.

Tolerance: both sides compute the same float32 math in a different order (packed
projections, a different attention kernel), so logits agree to a few ulps of their
magnitude; 1e-4 absolute on logits of order 1 leaves ample room for that and none for a
real bug (a wrong norm or rotation moves logits by ~1e-1).
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm.context import reset_context
from minivllm.contiguous_cache import generate
from minivllm.loader import load_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_qwen3):
    ours = load_model(tiny_qwen3)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    return ours, theirs


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("length", [1, 7, 64, 200])
def test_logits_match_transformers(models, length):
    ours, theirs = models
    ids = torch.randint(0, ours.config.vocab_size, (length,))
    reset_context()
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(length)), all_tokens=True)
        ref = theirs(ids[None]).logits[0]
    assert logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_greedy_matches_transformers(models):
    ours, theirs = models
    prompt = torch.randint(0, ours.config.vocab_size, (11,)).tolist()
    [tokens] = generate(ours, [prompt], max_new_tokens=40)
    assert len(tokens) == 40
    assert tokens == hf_greedy(theirs, prompt, 40)


def test_batch_equals_one_by_one(models):
    ours, theirs = models
    prompts = [torch.randint(0, ours.config.vocab_size, (n,)).tolist() for n in (3, 19, 50, 8)]
    batched = generate(ours, prompts, max_new_tokens=32)
    alone = [generate(ours, [p], max_new_tokens=32)[0] for p in prompts]
    assert batched == alone
    assert batched[1] == hf_greedy(theirs, prompts[1], 32)


def test_eos_stops_a_sequence(models):
    ours, _ = models
    prompt = [5, 6, 7]
    [free] = generate(ours, [prompt], max_new_tokens=10)
    eos = free[3]
    [stopped] = generate(ours, [prompt], max_new_tokens=10, eos_token_id=eos)
    assert stopped == free[: free.index(eos) + 1]


def test_generate_rejects_bad_input(models):
    ours, _ = models
    with pytest.raises(ValueError, match="non-empty"):
        generate(ours, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(ours, [[1] * 10], max_new_tokens=10_000)
