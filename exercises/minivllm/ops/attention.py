# Exercise copy of minivllm/ops/attention.py, generated from it by scripts/make_exercises.py.
# Fill in: causal_attention (ch02), sliding_window_attention (ch11), store_kvcache (ch05), quantize_kv (ch20), dequantize_kv (ch20), gather_kv (ch05), varlen_attention_reference (ch02).
# Grade: make grade CH=02; make grade CH=05; make grade CH=11; make grade CH=20
# Running the generator again overwrites this file: commit or copy your work first.

"""Attention ops: the torch reference.

Tokens arrive packed: q is [num_tokens, num_heads, head_dim] for all sequences of a step,
and the step's Context says where each sequence starts. Keys and values either come with
the step (no cache) or are written into a KV cache first and read back from it, so one
code path serves a first prefill, a prefill that continues cached context, and a decode.
"""
import torch
import torch.nn.functional as F

from minivllm.context import Context
from minivllm.ops.dispatch import use_triton


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Attention of one sequence's queries over its keys, causal, with grouped-query heads.

    q: [q_len, num_heads, head_dim]; k, v: [kv_len, num_kv_heads, head_dim], kv_len >= q_len.
    The queries are the *last* q_len positions of the sequence, so query i may see keys
    0 .. kv_len - q_len + i. Each group of num_heads / num_kv_heads query heads shares one
    key/value head. Returns [q_len, num_heads, head_dim].

    With ``sliding_window`` (local attention, e.g. Gemma 3's sliding layers) the query at
    position p sees only the keys j with p - sliding_window < j <= p.
    """
    if sliding_window is not None:
        return sliding_window_attention(q, k, v, scale, sliding_window)
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    raise NotImplementedError(
        "ch02: causal_attention: grouped-query attention: num_heads query heads share num_kv_heads "
        "key and value heads, each key/value head serving a run of consecutive query heads, so the "
        "key and value heads must be expanded to match the queries. Causality with a cache: the "
        "q_len queries are the last positions of kv_len keys, so query i sits at position kv_len - "
        "q_len + i and sees the keys at that position and before. PyTorch's fused attention takes "
        "[heads, length, dim] while the inputs are [length, heads, dim]; its boolean mask means "
        "True = may attend. Pitfall: a mask built as if q_len equalled kv_len is wrong as soon as "
        "a cache exists, see notebooks/02_attention.ipynb"
    )


def sliding_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int
) -> torch.Tensor:
    """causal_attention restricted to a window: the query at position p (the queries are the
    last q_len of kv_len positions) sees the keys j with p - sliding_window < j <= p.

    Built on plain causal attention: queries whose window still starts at key 0 are one
    causal call; every later query is a call of its own over exactly its window (as the last
    query of that slice, it sees all of it). Simple and correct; one call per query is slow
    for long prefills, which is acceptable for a reference.
    """
    raise NotImplementedError(
        "ch11: sliding_window_attention: a query at position p sees only the last sliding_window "
        "keys up to its own, positions p - sliding_window + 1 to p. The q_len queries are the last "
        "positions of kv_len keys. The queries at positions below sliding_window see every key up "
        "to their own: plain causal attention over a prefix of the keys, one call for all of them "
        "(how many there are, clipped to 0 .. q_len, follows from the first query's position). "
        "Every later query has a window of its own: one causal_attention call with that single "
        "query over its window. Pitfall: off by one at either end; the window holds exactly "
        "sliding_window keys, the query's own included, see notebooks/11_model_families.ipynb"
    )


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Write each new token's key and value into its slot of the cache.

    The cache is [num_blocks, block_size, num_kv_heads, head_dim]; slot s is row
    s % block_size of block s // block_size (indexed so, not through a flat view: a float8
    cache's values are laid out another way, ``value_cache_view``).
    Slot -1 marks a padding token that must not be stored. A float8 cache stores
    ``quantize_kv`` of them with the layer's ``k_scale`` and ``v_scale``.
    """
    k, v = quantize_kv(k, k_cache.dtype, k_scale), quantize_kv(v, v_cache.dtype, v_scale)
    raise NotImplementedError(
        "ch05: store_kvcache: write each token's key and value into the row its slot names, row "
        "slot mod block_size of block slot // block_size, assigning into the cache itself. Slot -1 "
        "is a padding token: store nothing for it. Pitfall: a write into a reshaped cache may go "
        "into a copy and be lost (chapter 20 lays float8 values out so that reshaping them "
        "copies), see notebooks/05_paged_blocks.ipynb"
    )


# e4m3's largest finite value: 448 = 1.75 * 2^8 (its top code is NaN, so there is no inf).
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    """Is this a float8 KV cache's dtype (values stored divided by a scale)?"""
    return dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Keys or values as a cache of ``cache_dtype`` holds them. Float8: x / scale (in
    float32, as x * (1 / scale), which the Triton kernels compute too), clamped to [-448,
    448] and rounded to e4m3, so that a value past the range saturates at 448 instead of
    becoming NaN (e4m3 has no inf; what a cast makes of such a value is the
    implementation's choice). Any other dtype: x."""
    raise NotImplementedError(
        "ch20: quantize_kv: a cache whose dtype is not a float8 one (is_fp8) holds keys and values "
        "as they are. A float8 cache holds each value over the layer's scale, in float32, "
        "saturated to e4m3's range and rounded to the cache's dtype. Divide as the Triton kernels "
        "do, by multiplying by the scale's reciprocal: the two paths then store the same bits, see "
        "notebooks/20_quantization.ipynb"
    )


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached keys or values back in ``dtype``: float8 ones times their scale (in
    float32), any other as they are. The Triton kernels never do this multiply per
    element: they fold the scales into the softmax scale and the output."""
    raise NotImplementedError(
        "ch20: dequantize_kv: the inverse for reading: float8 entries times the layer's scale, "
        "computed in float32 and only then given the dtype asked for (multiplying in bfloat16 "
        "rounds twice); entries of any other dtype come back as they are, see "
        "notebooks/20_quantization.ipynb"
    )


def value_cache_view(memory: torch.Tensor) -> torch.Tensor:
    """The V cache in a contiguous buffer ``memory`` [num_blocks, block_size, kv_heads,
    head_dim]: itself, or for a float8 cache the same memory read key-contiguous
    ([num_blocks, kv_heads, head_dim, block_size], the layout its attention kernels load
    fast: kernels/kv_store.py says why), seen through strides in the usual shape, so that
    torch code indexes it as any cache."""
    if not is_fp8(memory.dtype):
        return memory
    num_blocks, block_size, kv_heads, head_dim = memory.shape
    return memory.view(num_blocks, kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence, read through its block table."""
    raise NotImplementedError(
        "ch05: gather_kv: the first length tokens of a sequence, in order: the blocks its table "
        "names (as many as length needs, rounding up), flattened into one run of tokens and cut at "
        "length. Pitfall: rounding the block count down loses the last, partly filled block, see "
        "notebooks/05_paged_blocks.ipynb"
    )


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
    ctx: Context, scale: float, sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a packed batch of sequences: the Triton kernels on a GPU, the torch
    reference elsewhere (and whenever there is no cache, e.g. a warm-up pass). ``k_scale``,
    ``v_scale``: a float8 cache's scales (the layer's, float32 tensors of one element)."""
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    use_cache = k_cache is not None and ctx.slot_mapping is not None
    if use_cache and use_triton(q):
        from minivllm.kernels import kv_store, paged_attention

        if (ctx.is_prefill and ctx.cu_seqlens_q is not None
                and paged_attention.takes_short_prefill(ctx.max_seqlen_q, q.shape[1] // k_cache.shape[2], q.shape[2])
                and paged_attention.short_prefill_pays(ctx.cu_seqlens_q.shape[0] - 1, k_cache.shape[2],
                                                       paged_attention.sm_count(q))):
            # Few queries a sequence and few sequences (a verifying step at a small batch):
            # split the context as a decode step does, the KV store fused.
            return paged_attention.paged_short_prefill_attention(
                q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q, ctx.max_seqlen_q, scale,
                ctx.max_context_len, k, v, ctx.slot_mapping, sliding_window=sliding_window, **scales)
        if ctx.is_prefill:
            kv_store.store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping, **scales)
            return paged_attention.paged_prefill_attention(
                q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q, ctx.max_seqlen_q, scale,
                sliding_window=sliding_window, k=k, v=v, config={"FROM_SCRATCH": True} if ctx.from_scratch else None,
                **scales)
        # A decode step: the attention kernel stores the new keys and values itself.
        return paged_attention.paged_decode_attention(
            q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, ctx.max_context_len,
            sliding_window=sliding_window, k=k, v=v, slot_mapping=ctx.slot_mapping, **scales)
    return varlen_attention_reference(q, k, v, k_cache, v_cache, ctx, scale, sliding_window, **scales)


def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
    ctx: Context, scale: float, sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: one sequence at a time.

    Without a cache each sequence attends over its own tokens in this step. With one, the
    new keys and values are stored first and each sequence then attends over everything it
    has cached (context_lens), prefix and new tokens alike. With ``sliding_window`` each
    query sees only the last ``sliding_window`` positions up to its own. A float8 cache
    is read back dequantized with ``k_scale`` and ``v_scale``: every key, the step's own
    included, is attended as the cache holds it.
    """
    use_cache = k_cache is not None and ctx.slot_mapping is not None
    if use_cache:
        store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping, k_scale, v_scale)
    raise NotImplementedError(
        "ch02: varlen_attention_reference: one sequence at a time. Tokens of the step arrive "
        "packed, sequence i's queries being rows cu_seqlens_q[i] to cu_seqlens_q[i + 1] (no "
        "cu_seqlens_q: one sequence, all rows). Without a cache (no k_cache, or no slot_mapping) "
        "each sequence attends over its own keys of this step. With one (the step's keys and "
        "values are in their slots already), read back each sequence's first context_lens[i] keys "
        "and values through its block table: cached prefix and new tokens alike, its queries being "
        "the last of them. With a sliding window, drop the keys that even the first query cannot "
        "see (positions are relative, so what is left still ends at the last query) and pass the "
        "window on to causal_attention. Pitfall: reading only this step's keys forgets the cached "
        "prefix, see notebooks/02_attention.ipynb"
    )
