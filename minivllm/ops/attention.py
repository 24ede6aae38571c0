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
    # BEGIN SOLUTION ch02 causal_attention
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    query_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
    key_pos = torch.arange(kv_len, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)
    # END SOLUTION


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
    # BEGIN SOLUTION ch11 sliding_window_attention
    q_len, kv_len = q.shape[0], k.shape[0]
    offset = kv_len - q_len  # position of the first query
    out = torch.empty_like(q)
    head = min(q_len, max(0, sliding_window - offset))  # queries at positions < sliding_window
    if head:
        out[:head] = causal_attention(q[:head], k[: offset + head], v[: offset + head], scale)
    for i in range(head, q_len):
        p = offset + i
        window = slice(p - sliding_window + 1, p + 1)
        out[i : i + 1] = causal_attention(q[i : i + 1], k[window], v[window], scale)
    return out
    # END SOLUTION


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
    # BEGIN SOLUTION ch05 store_kvcache
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache[slots // block_size, slots % block_size] = k[valid]
    v_cache[slots // block_size, slots % block_size] = v[valid]
    # END SOLUTION


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
    # BEGIN SOLUTION ch20 quantize_kv
    if not is_fp8(cache_dtype):
        return x
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)
    # END SOLUTION


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached keys or values back in ``dtype``: float8 ones times their scale (in
    float32), any other as they are. The Triton kernels never do this multiply per
    element: they fold the scales into the softmax scale and the output."""
    # BEGIN SOLUTION ch20 dequantize_kv
    if not is_fp8(x.dtype):
        return x
    return (x.float() * scale).to(dtype)
    # END SOLUTION


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
    # BEGIN SOLUTION ch05 gather_kv
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks]]  # [num_blocks, block_size, heads, dim]
    return blocks.flatten(0, 1)[:length]
    # END SOLUTION


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
    # BEGIN SOLUTION ch02 varlen_reference
    cu_seqlens = torch.tensor([0, q.shape[0]]) if ctx.cu_seqlens_q is None else ctx.cu_seqlens_q.cpu()
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        if use_cache:
            length = int(ctx.context_lens[i])
            k_i = dequantize_kv(gather_kv(k_cache, ctx.block_tables[i], length), q.dtype, k_scale)
            v_i = dequantize_kv(gather_kv(v_cache, ctx.block_tables[i], length), q.dtype, v_scale)
        else:
            k_i, v_i = k[start:end], v[start:end]
        if sliding_window is not None:
            # Keys older than the first query's window are never seen: drop them. Positions
            # are relative, so the queries stay the last (end - start) of what is left.
            first = max(0, k_i.shape[0] - (end - start) - sliding_window + 1)
            k_i, v_i = k_i[first:], v_i[first:]
        out[start:end] = causal_attention(q[start:end], k_i, v_i, scale, sliding_window)
    return out
    # END SOLUTION
