"""Attention over the paged KV cache: a decode kernel and a prefill kernel.

Both read keys and values through block tables, token j of sequence b living at row
j % block_size of block block_tables[b, j // block_size], and both use the online softmax
(FlashAttention): scores are consumed tile by tile with a running max m, running sum l and
a rescaled accumulator, so the [queries x keys] matrix never exists in memory.

Decode (one query per sequence) is memory-bound: it must read every cached key and value.
  bytes ~ 2 * context_tokens * num_kv_heads * head_dim * dtype_size (+ q and out)
  FLOPs ~ 4 * context_tokens * num_heads * head_dim
One program handles one (sequence, kv head, split of the context); all query heads of a
GQA group share each loaded K/V tile. Long contexts with few sequences are split so the
GPU has enough programs; a second small kernel merges the splits' partial softmaxes.

Prefill is compute-bound for long prompts:
  bytes ~ 2 * q_len * num_heads * head_dim * dtype_size (q in, out once)
          + 2 * kv_len * num_kv_heads * head_dim * dtype_size * cdiv(q_len, BLOCK_M)
          (each program, BLOCK_M queries of one KV group, reads K and V up to its causal
          limit: about half of that in all, mostly from L2)
  FLOPs ~ 2 * 2 * q_len * kv_len * num_heads * head_dim (halved by causality)
One program handles BLOCK_M query positions of one sequence for all the query heads of one
KV group (a [BLOCK_M * group, head_dim] tile, so each K/V tile it loads serves the whole
group) and walks the keys up to its causal limit: first the tiles every query sees, without
a mask, then the few on the diagonal, masked. Cached prefix tokens are just more keys.

Both kernels fold each tile of scores into the running softmax with one helper,
``_online_softmax_update``.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.common import dot_precision


@triton.jit
def _online_softmax_update(m, l, acc, s, v, PRECISION: tl.constexpr):
    """Fold one tile into the running softmax of each row (a query): scores s [rows, keys]
    (-inf where a key is not visible), values v [keys, head_dim]; m [rows] is the running
    max, l [rows] the running sum, acc [rows, head_dim] the running weighted values.
    Returns the new (m, l, acc)."""
    # BEGIN SOLUTION ch09 online_softmax_1
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # Rows with nothing visible yet keep m = -inf; shift by 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    # END SOLUTION
    # BEGIN SOLUTION ch09 online_softmax_2
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    # END SOLUTION
    return m_new, l, acc


@triton.jit(do_not_specialize=["stride_bt", "PARTITION"])
def _decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32
    scale,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    PARTITION, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b)
    start = split * PARTITION
    end = tl.minimum(start + PARTITION, context_len)
    # A sliding window (window > 0) hides every key before context_len - window: skip the
    # whole tiles before it (start stays a multiple of BLOCK_N) and mask the rest.
    first = tl.maximum(tl.where(window > 0, context_len - window, 0), 0)
    start = tl.maximum(start, first // BLOCK_N * BLOCK_N)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < GROUP, other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = (n < end) & (n >= first)
        block = tl.load(block_tables_ptr + b * stride_bt + n // BLOCK_SIZE, mask=valid, other=0)
        row = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        m, l, acc = _online_softmax_update(m, l, acc, s, v, PRECISION)

    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
    mask = g < GROUP
    base = b * stride_pt + heads * stride_ph + split * stride_ps
    tl.store(part_out_ptr + base[:, None] + d[None, :], out, mask=mask[:, None])
    tl.store(part_lse_ptr + b * stride_lt + heads * stride_lh + split, lse, mask=mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    smask = s < num_splits
    lse = tl.load(part_lse_ptr + b * stride_lt + h * stride_lh + s, mask=smask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # A padding row (no keys at all) has every lse at -inf: its output is zero.
    w = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0)), 0.0)
    parts = tl.load(part_out_ptr + b * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=smask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int = 132) -> int:
    """Enough splits that the GPU gets about two programs per multiprocessor, but no split
    shorter than 256 tokens (below that the merge costs more than it gains)."""
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context_len, 256)))


def decode_config(head_dim: int) -> dict:
    """Tile shape of the decode kernel: BLOCK_N keys per step (a K/V tile is [BLOCK_N,
    head_dim], halved for wide heads to bound it), and the launch's warps and pipeline
    stages. Set by hand when the kernel was written; scripts/tune_attention.py sweeps them
    (benchmarks/attention_tuning.json), and ``minivllm bench kernels`` measures the result
    against the copy bandwidth."""
    return {"BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 4, "num_stages": 3}


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim] (one query per sequence). Returns the same shape.
    With ``sliding_window`` each query sees only the last sliding_window keys. ``config``:
    the tile shape (``decode_config``'s keys), for tuning.

    ``max_context_len`` bounds the context lengths (it sizes the splits; under a CUDA graph
    it is the engine's max_model_len, since the real lengths change at every replay).
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if num_heads % num_kv_heads or head_dim & (head_dim - 1):
        raise ValueError(f"need num_heads % num_kv_heads == 0 and a power-of-two head_dim, got {q.shape}, {k_cache.shape}")
    if num_seqs and max_context_len < 1:
        # Checked on the host: the grid is sized from it, and keys past the last split are never read.
        raise ValueError(f"max_context_len must bound every sequence's context length (>= 1), got {max_context_len}")
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context_len, sms)
    config = config or decode_config(head_dim)
    block_n = config["BLOCK_N"]
    partition = triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), block_n) * block_n
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        partition, sliding_window or 0,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, PRECISION=dot_precision(q.dtype), **config,
    )
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    _merge_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits, HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return out


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32: keys per sequence, cached prefix included
    cu_seqlens_ptr,  # [num_seqs + 1] int32: where each sequence's queries start in q
    out_ptr,  # [num_tokens, num_heads, head_dim]
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    kv_len = tl.load(context_lens_ptr + b)
    offset = kv_len - q_len  # the queries are the last q_len positions of the sequence

    # The tile's rows: BLOCK_M query positions x the BLOCK_G heads of one KV group (position
    # major), so every K/V tile loaded serves the whole group.
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    m_idx = tile * BLOCK_M + r // BLOCK_G
    g = r % BLOCK_G
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    row_valid = (m_idx < q_len) & (g < GROUP)
    q = tl.load(q_ptr + (q_start + m_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None], other=0.0)
    q_pos = offset + m_idx

    m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, HEAD_DIM], tl.float32)
    first_q = offset + tile * BLOCK_M
    # Keys beyond the tile's last query are masked for every row: stop there.
    hi = tl.minimum(kv_len, first_q + BLOCK_M)
    # With a sliding window, keys before the first query's window are masked for every row:
    # start at the tile that holds the first visible one, and mask every tile. Without one,
    # the tiles wholly at or before the first query are visible to every row: no mask there.
    lo = tl.where(window > 0, tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    mid = tl.where(window > 0, lo, (first_q + 1) // BLOCK_N * BLOCK_N)
    for n0 in range(lo, mid, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        block = tl.load(block_tables_ptr + b * stride_bt + n // BLOCK_SIZE)
        row = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :])
        m, l, acc = _online_softmax_update(m, l, acc, s, v, PRECISION)
    for n0 in range(mid, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < hi
        block = tl.load(block_tables_ptr + b * stride_bt + n // BLOCK_SIZE, mask=valid, other=0)
        row = block.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = valid[None, :] & (n[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        m, l, acc = _online_softmax_update(m, l, acc, s, v, PRECISION)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def prefill_config(head_dim: int, group: int, on_gpu: bool = True) -> dict:
    """Tile shape of the prefill kernel: BLOCK_M query positions (times the KV group's heads
    per tile), BLOCK_N keys per step, and the launch's warps and pipeline stages. On the GPU
    from scripts/tune_attention.py on an H200 (benchmarks/attention_tuning.json); in the
    interpreter (CPU tests) small tiles, so that short test sequences span several."""
    block_g = triton.next_power_of_2(group)
    if not on_gpu:
        return {"BLOCK_M": max(1, 16 // block_g), "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    # 64 query rows per tile (positions x the group's heads), 64 keys per step, 4 warps, 2
    # stages: the sweep's best on the three workloads of head_dim 128 (tiles of 128 rows and
    # 8 warps were 10-25% slower). Wider heads halve the key tile.
    return {"BLOCK_M": max(16, 64 // block_g), "BLOCK_N": 64 if head_dim <= 128 else 32,
            "num_warps": 4, "num_stages": 2}


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    sliding_window: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], packed sequences (cu_seqlens_q); their keys and
    values, cached prefix included, are already in the cache. Causal, and with
    ``sliding_window`` the query at position p sees keys j with p - sliding_window < j <= p.
    ``config``: the tile shape (``prefill_config``'s keys), for tuning. Returns q's shape."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or head_dim & (head_dim - 1):
        raise ValueError(f"need num_heads % num_kv_heads == 0 and a power-of-two head_dim, got {q.shape}, {k_cache.shape}")
    if num_tokens and max_seqlen_q < 1:
        # The grid has cdiv(max_seqlen_q, BLOCK_M) query tiles per sequence: with 0, nothing would run.
        raise ValueError(f"max_seqlen_q must bound every sequence's query length (>= 1), got {max_seqlen_q}")
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    group = num_heads // num_kv_heads
    config = config or prefill_config(head_dim, group, q.is_cuda)
    grid = (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), sliding_window or 0,
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PRECISION=dot_precision(q.dtype), **config,
    )
    return out
