"""Chapter 04 — the size of a KV cache.

Your ``kv_cache_bytes`` (exercises/minivllm/contiguous_cache.py) is compared with the bytes of
tensors of the same shape and dtype (on the ``meta`` device, so nothing is allocated), for
random shapes and every dtype from float64 down to float8; then with what the package
really allocates: the contiguous cache of this chapter and the engine's paged KV pool; and
with the published per-token sizes of real models. Sizes are integers: the answer must be
exact, and an ``int``.

Also graded: the contiguous cache's layout and views, and the generation loop of
``generate``, token for token against transformers' greedy continuation.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from minivllm.contiguous_cache import ContiguousKVCache, kv_cache_bytes
from minivllm.loader import load_model

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def allocated_bytes(num_layers, num_kv_heads, head_dim, num_tokens, dtype) -> int:
    """What a [2 (k, v), layers, tokens, kv_heads, head_dim] tensor of dtype occupies."""
    t = torch.empty(2, num_layers, num_tokens, num_kv_heads, head_dim, dtype=dtype, device="meta")
    return t.numel() * t.element_size()


def check(num_layers, num_kv_heads, head_dim, num_tokens, dtype, expected=None):
    got = kv_cache_bytes(num_layers, num_kv_heads, head_dim, num_tokens, dtype)
    if expected is None:
        expected = allocated_bytes(num_layers, num_kv_heads, head_dim, num_tokens, dtype)
    assert isinstance(got, int) and not isinstance(got, bool), (
        f"kv_cache_bytes must return an int (a number of bytes), got {type(got).__name__} {got!r}"
    )
    assert got == expected, (
        f"kv_cache_bytes(num_layers={num_layers}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, "
        f"num_tokens={num_tokens}, dtype={dtype}) = {got:,d}, expected {expected:,d} "
        f"(a key and a value per token, head and layer, {torch.empty((), dtype=dtype).element_size()} bytes each)"
    )


@settings(max_examples=60)
@given(
    num_layers=st.integers(1, 96),
    num_kv_heads=st.integers(1, 16),
    head_dim=st.sampled_from([1, 16, 64, 80, 96, 128, 256]),
    num_tokens=st.integers(0, 100_000),
    dtype=st.sampled_from(DTYPES),
)
def test_ch04_kv_cache_bytes_matches_tensor_sizes(num_layers, num_kv_heads, head_dim, num_tokens, dtype):
    check(num_layers, num_kv_heads, head_dim, num_tokens, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ch04_kv_cache_bytes_depends_on_dtype(dtype):
    # One token of a 2-layer, 2-head, 16-wide cache: 2 * 2 * 2 * 16 = 128 elements.
    check(2, 2, 16, 1, dtype, expected=128 * torch.empty((), dtype=dtype).element_size())


@pytest.mark.parametrize(
    "name, shape, per_token",
    [
        # (layers, kv heads, head_dim) from the published config.json files; bfloat16 cache.
        ("Qwen3-0.6B", (28, 8, 128), 114_688),
        ("Qwen3-8B", (36, 8, 128), 147_456),
        ("Llama-3.1-70B", (80, 8, 128), 327_680),
    ],
)
def test_ch04_kv_cache_bytes_of_real_models(name, shape, per_token):
    check(*shape, 1, torch.bfloat16, expected=per_token)
    check(*shape, 40_960, torch.bfloat16, expected=per_token * 40_960)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ch04_contiguous_cache_reserves_kv_cache_bytes(tiny_qwen3, dtype):
    model = load_model(tiny_qwen3, dtype=dtype)
    cfg = model.config
    cache = ContiguousKVCache(model, batch_size=3, max_len=40)
    try:
        expected = cache.kv.numel() * cache.kv.element_size()
        check(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 3 * 40, dtype, expected=expected)
        assert cache.nbytes() == expected
        assert cache.bytes_per_token() * 3 * 40 == expected, "ContiguousKVCache.bytes_per_token uses kv_cache_bytes"
    finally:
        cache.detach()


@pytest.mark.parametrize("dtype, block_size", [("float32", 16), ("bfloat16", 8)])
def test_ch04_engine_pool_is_num_blocks_blocks_of_kv_cache_bytes(tiny_qwen3, dtype, block_size):
    from minivllm import LLM

    llm = LLM(model=tiny_qwen3, dtype=dtype, device="cpu", num_kv_blocks=12, block_size=block_size)
    runner = llm.engine.runner
    cfg = runner.model_config
    pool = runner.kv_cache.numel() * runner.kv_cache.element_size()
    check(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 12 * block_size, runner.kv_cache.dtype,
          expected=pool)
    check(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, runner.kv_cache.dtype,
          expected=runner.block_bytes)


# --- the contiguous cache and the generation loop -------------------------------------

from minivllm.contiguous_cache import generate  # noqa: E402
from minivllm.layers.attention import attention_layers  # noqa: E402


def test_ch04_contiguous_cache_layout(tiny_qwen3):
    model = load_model(tiny_qwen3, dtype=torch.bfloat16)
    cfg = model.config
    cache = ContiguousKVCache(model, batch_size=2, max_len=7)
    try:
        expected = (cfg.num_hidden_layers, 2, 2, 7, cfg.num_key_value_heads, cfg.head_dim)
        assert tuple(cache.kv.shape) == expected, (
            f"one tensor [layers, 2 (key, value), batch_size, max_len, kv_heads, head_dim]: {tuple(cache.kv.shape)}, "
            f"expected {expected}")
        assert cache.kv.dtype == torch.bfloat16, f"the cache is in the model's dtype: {cache.kv.dtype}"
        assert not cache.kv.any(), "a fresh cache holds zeros"
        assert (cache.batch_size, cache.max_len) == (2, 7)
        for i, layer in enumerate(attention_layers(model)):
            layer.k_cache[1, 3] = i + 1
            layer.v_cache[0, 6] = -(i + 1)
            assert (cache.kv[i, 0, 1, 3] == i + 1).all() and (cache.kv[i, 1, 0, 6] == -(i + 1)).all(), (
                f"layer {i}'s k_cache and v_cache must be views of the cache's layer {i}, key then value: "
                "what the attention writes must land in the cache")
    finally:
        cache.detach()
    assert all(layer.k_cache is None and layer.v_cache is None for layer in attention_layers(model)), \
        "detach takes the keys' and the values' caches off every layer"


def hf_greedy(hf_model, prompt, max_new_tokens, eos=None):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("lengths, max_new_tokens", [([5], 6), ([3, 9, 1], 5), ([4, 4], 1)],
                         ids=["one", "ragged-batch", "one-token"])
def test_ch04_generate_matches_transformers(tiny_qwen3, hf_qwen3, lengths, max_new_tokens):
    model = load_model(tiny_qwen3)
    g = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    outputs = generate(model, prompts, max_new_tokens)
    assert len(outputs) == len(prompts), "one list of new tokens per prompt"
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(hf_qwen3, prompt, max_new_tokens)
        assert outputs[i] == expected, (
            f"prompt {i} ({len(prompt)} tokens, in a batch of {len(prompts)}): {outputs[i]}, transformers' greedy "
            f"continuation {expected}: prefill all prompts, then decode one token a sequence at its own position and slot")


def test_ch04_generate_stops_a_sequence_at_eos(tiny_qwen3, hf_qwen3):
    model = load_model(tiny_qwen3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (6, 4)]
    free_run = [hf_greedy(hf_qwen3, p, 6) for p in prompts]
    eos = free_run[0][2]  # the first sequence's third token ends it
    outputs = generate(model, prompts, 6, eos_token_id=eos)
    assert outputs[0] == free_run[0][: free_run[0].index(eos) + 1], (
        f"a sequence ends with the EOS token it sampled, included: {outputs[0]}, from {free_run[0]}, eos {eos}")
    expected_other = free_run[1][: free_run[1].index(eos) + 1] if eos in free_run[1] else free_run[1]
    assert outputs[1] == expected_other, (
        f"the other sequence goes on to max_new_tokens (or its own EOS): {outputs[1]}, expected {expected_other}")
