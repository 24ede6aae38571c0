"""Chapter 02 — causal attention with grouped-query heads.

Your ``causal_attention`` (exercises/minivllm/ops/attention.py) is compared with attention
written out in float64 (transformers' ``repeat_kv`` for the head groups, an explicit mask
and softmax) on random queries, keys and values: prefills, decodes (one query over a long
context) and chunks in between, with every head grouping. Then it runs inside the engine:
packed batches of sequences, and a Qwen3 model reading its KV cache, against transformers.

Tolerances, against the float64 reference: float32 1e-4 (the score sums and the softmax each
lose a few ulps); bfloat16 5e-2 and float16 1e-2 (scores rounded to the dtype before the
softmax move the weights by that much). A wrong mask or head mapping moves outputs by ~0.5.

Also graded: the attention layer (exercises/minivllm/models/qwen3.py) and the packed-batch
reference ``varlen_attention_reference``, over paged caches with scattered blocks, cached
prefixes and sliding windows.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from transformers.models.qwen3.modeling_qwen3 import repeat_kv

from minivllm.context import reset_context, set_context
from minivllm.contiguous_cache import ContiguousKVCache
from minivllm.loader import load_model
from minivllm.ops.attention import causal_attention, varlen_attention

TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def reference_attention(q, k, v, scale):
    """q: [q_len, heads, dim]; k, v: [kv_len, kv_heads, dim]; the queries are the last q_len positions."""
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qh = q.double().transpose(0, 1)[None]  # [1, heads, q_len, dim]
    kh = repeat_kv(k.double().transpose(0, 1)[None], group)
    vh = repeat_kv(v.double().transpose(0, 1)[None], group)
    scores = qh @ kh.transpose(-1, -2) * scale
    query_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    key_pos = torch.arange(kv_len)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return (scores.softmax(-1) @ vh)[0].transpose(0, 1).to(q.dtype)


def random_qkv(q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(kv_len, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_len, num_kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


def check(q, k, v, scale):
    before = [t.clone() for t in (q, k, v)]
    out = causal_attention(q, k, v, scale)
    assert all(torch.equal(t, b) for t, b in zip((q, k, v), before)), "causal_attention must not change its inputs"
    expected = reference_attention(q, k, v, scale)
    assert isinstance(out, torch.Tensor), f"expected a tensor, got {type(out).__name__}"
    assert out.shape == expected.shape, f"shape {tuple(out.shape)}, expected {tuple(expected.shape)} ([q_len, heads, dim])"
    assert out.dtype == q.dtype, f"dtype {out.dtype}, expected {q.dtype}"
    tol = TOL[q.dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@settings(max_examples=40)
@given(
    q_len=st.integers(1, 8),
    context=st.integers(0, 8),  # kv_len - q_len: keys cached before these queries
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([1, 4, 16, 64]),
    scale_factor=st.floats(0.5, 2.0),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31),
)
def test_ch02_causal_attention_matches_reference(q_len, context, num_kv_heads, group, head_dim, scale_factor, dtype, seed):
    q, k, v = random_qkv(q_len, q_len + context, num_kv_heads * group, num_kv_heads, head_dim, dtype, seed)
    check(q, k, v, scale_factor * head_dim**-0.5)


@pytest.mark.parametrize("q_len, kv_len", [(1, 1), (6, 6), (1, 9), (3, 10)], ids=["one", "prefill", "decode", "chunk"])
def test_ch02_causal_mask_and_offset(q_len, kv_len):
    # The queries are the last q_len positions: a decode's single query sees every key.
    q, k, v = random_qkv(q_len, kv_len, 2, 2, 8, torch.float32, q_len * 100 + kv_len)
    check(q, k, v, 8**-0.5)


def test_ch02_query_heads_share_kv_heads_in_groups():
    # 6 query heads over 2 kv heads: heads 0-2 read kv head 0 and heads 3-5 kv head 1
    # (repeat_interleave), not 0, 1, 0, 1, 0, 1 (repeat).
    q, k, v = random_qkv(4, 7, 6, 2, 8, torch.float32, 7)
    v[:, 1] += 10.0  # kv head 1's values stand out, so a wrong grouping cannot hide
    check(q, k, v, 8**-0.5)


def test_ch02_uses_the_given_scale():
    q, k, v = random_qkv(5, 5, 4, 2, 16, torch.float32, 11)
    check(q, k, v, 0.7)  # not 16 ** -0.5, the default of scaled_dot_product_attention


def test_ch02_packed_sequences_do_not_see_each_other():
    # Three sequences packed into one batch of tokens, no cache: each attends to itself only.
    lens = [3, 1, 5]
    total = sum(lens)
    q, k, v = random_qkv(total, total, 4, 2, 8, torch.float32, 3)
    cu = torch.tensor([0, *lens]).cumsum(0)
    ctx = set_context(is_prefill=True, cu_seqlens_q=cu)
    try:
        out = varlen_attention(q, k, v, None, None, ctx, 0.3)
    finally:
        reset_context()
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expected = reference_attention(q[start:end], k[start:end], v[start:end], 0.3)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-4, atol=1e-4)


def windowed_reference(q, k, v, scale, window):
    """reference_attention where the query at position p sees only keys p - window + 1 .. p."""
    q_len, kv_len = q.shape[0], k.shape[0]
    out = torch.empty_like(q)
    for i in range(q_len):
        p = kv_len - q_len + i
        lo = max(0, p - window + 1)
        out[i : i + 1] = reference_attention(q[i : i + 1], k[lo : p + 1], v[lo : p + 1], scale)
    return out


def paged_step(lens_cached, lens_new, block_size=4, num_blocks=16, seed=0, window=None):
    """A step over several sequences, each with cached tokens and new ones, their blocks
    scattered through a paged cache. Returns (out, expected per sequence, k_cache)."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, qs, ks, vs, slots, full = [], [], [], [], [], []
    width = max(-(-(c + n) // block_size) for c, n in zip(lens_cached, lens_new))
    for cached, new in zip(lens_cached, lens_new):
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        q, k, v = random_qkv(new, total, heads, kv_heads, dim, torch.float32, int(torch.randint(0, 99, (1,), generator=g)))
        for t in range(cached):  # what earlier steps stored
            b, o = table[t // block_size], t % block_size
            k_cache[b, o], v_cache[b, o] = k[t], v[t]
        slots += [table[t // block_size] * block_size + t % block_size for t in range(cached, total)]
        qs.append(q); ks.append(k[cached:]); vs.append(v[cached:]); full.append((q, k, v))
        tables.append(table + [0] * (width - len(table)))
    cu = torch.tensor([0, *lens_new]).cumsum(0)
    ctx = set_context(is_prefill=max(lens_new) > 1, cu_seqlens_q=cu, slot_mapping=torch.tensor(slots),
                      context_lens=torch.tensor([c + n for c, n in zip(lens_cached, lens_new)]),
                      block_tables=torch.tensor(tables))
    try:
        out = varlen_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, ctx, 0.4, window)
    finally:
        reset_context()
    expected = [windowed_reference(q, k, v, 0.4, window) if window else reference_attention(q, k, v, 0.4)
                for q, k, v in full]
    return out, torch.cat(expected), cu


@pytest.mark.parametrize("cached, new", [([0, 0], [5, 3]), ([6, 9, 3], [1, 1, 1]), ([4, 7], [5, 2]), ([3], [8])],
                         ids=["prefill", "decode", "cached-prefix", "one-sequence"])
def test_ch02_varlen_reads_the_cache_through_block_tables(cached, new):
    out, expected, cu = paged_step(cached, new, seed=len(cached) + sum(new))
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        torch.testing.assert_close(out[start:end], expected[start:end], rtol=1e-4, atol=1e-4, msg=lambda m: (
            f"sequence {i}: its queries attend over its cached keys and this step's own (stored first, then read "
            f"back through its block table), the queries being the last of them: {m}"))


@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("cached, new", [([0, 0], [7, 4]), ([9, 5], [1, 1]), ([6], [5])], ids=["prefill", "decode", "chunk"])
def test_ch02_varlen_with_a_sliding_window(cached, new, window):
    out, expected, _ = paged_step(cached, new, seed=window, window=window)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, msg=lambda m: (
        f"with a window of {window}, each query sees only the last {window} positions up to its own: {m}"))


@pytest.mark.parametrize("window", [None, 2])
def test_ch02_varlen_without_a_cache_or_cumulative_lengths(window):
    # No cu_seqlens_q: one sequence, every row; no cache: the step's own keys.
    q, k, v = random_qkv(6, 6, 4, 1, 8, torch.float32, 5)
    ctx = set_context(is_prefill=True)
    try:
        out = varlen_attention(q, k, v, None, None, ctx, 0.5, window)
    finally:
        reset_context()
    expected = windowed_reference(q, k, v, 0.5, window) if window else reference_attention(q, k, v, 0.5)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"without cu_seqlens_q every row is one sequence: {m}")


# --- the whole model ------------------------------------------------------------------


def logits_in_chunks(model, ids, chunks):
    """Run one sequence through the model chunk by chunk, reading earlier tokens from a KV
    cache; return the logits of every token."""
    cache = ContiguousKVCache(model, batch_size=1, max_len=len(ids))
    out, start = [], 0
    try:
        for n in chunks:
            set_context(
                is_prefill=n > 1,
                cu_seqlens_q=torch.tensor([0, n]),
                slot_mapping=torch.arange(start, start + n),
                context_lens=torch.tensor([start + n]),
                block_tables=torch.tensor([[0]]),
            )
            with torch.no_grad():
                hidden = model(ids[start : start + n], torch.arange(start, start + n))
                out.append(model.compute_logits(hidden, all_tokens=True))
            start += n
    finally:
        reset_context()
        cache.detach()
    return torch.cat(out)


@pytest.mark.parametrize("chunks", [[12], [8, 1, 1, 1, 1], [5, 4, 3]], ids=["prefill", "decode", "chunked-prefill"])
def test_ch02_qwen3_with_kv_cache_matches_transformers(tiny_qwen3, hf_qwen3, chunks):
    # Float32 on both sides, the same math in another order: ~1e-6 on logits of order 1;
    # 1e-4 leaves room for that, and none for a query that sees the wrong keys (~1e-1).
    model = load_model(tiny_qwen3)
    length = sum(chunks)
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(len(chunks)))
    logits = logits_in_chunks(model, ids, chunks)
    with torch.no_grad():
        expected = hf_qwen3(ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
