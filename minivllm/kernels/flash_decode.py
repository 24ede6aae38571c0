"""Paged decode attention in two stages, written to be read: the kernel chapter 09 teaches.
  bytes 2 * context * kv_heads * head_dim * dtype_size (each cached key and value read once)

One query per sequence attends to its cached keys and values, read in place through the
block table: key j of sequence b is row j % BLOCK_SIZE of block block_tables[b, j // BLOCK_SIZE].
Stage 1: one program per (sequence, K/V head, split of the context), whose rows are the query
heads of one GQA group (each block loaded serves them all), walks its split's blocks one at a
time with the online softmax and writes its running max m, sum l and unnormalised output.
Stage 2: one program per (sequence, query head) merges the splits. The engine runs the tuned
kernel of ``paged_attention.py`` on the same plan; chapter 09 measures what it adds.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(
    q_ptr,  # [num_seqs, num_heads, HEAD_DIM], num_heads = num_kv_heads * GROUP
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32, each at least 1
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM] float32: sum of e^(s - m) * v
    part_m_ptr,  # [num_seqs, num_heads, num_splits] float32: the largest score m
    part_l_ptr,  # [num_seqs, num_heads, num_splits] float32: sum of e^(s - m)
    scale, max_blocks,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_kv_heads, num_splits = tl.num_programs(1), tl.num_programs(2)
    g = tl.arange(0, BLOCK_G)  # [BLOCK_G]: the group's query heads, padded to a power of two
    d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    r = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]: the rows of one cache block
    heads = kv_head * GROUP + g  # [BLOCK_G]
    real = g < GROUP  # [BLOCK_G]: padding rows are loaded as zeros and never stored
    q = tl.load(q_ptr + (seq * num_kv_heads * GROUP + heads)[:, None] * HEAD_DIM + d[None, :],
                mask=real[:, None], other=0.0)  # [BLOCK_G, HEAD_DIM]
    context_len = tl.load(context_lens_ptr + seq)
    # BEGIN SOLUTION ch09 split_pass
    # This split's share of the sequence's cache blocks, [first, last): maybe none.
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks, num_splits)
    first = split * per_split
    last = tl.minimum(first + per_split, num_blocks)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # [BLOCK_G]
    l = tl.zeros([BLOCK_G], tl.float32)  # [BLOCK_G]
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)  # [BLOCK_G, HEAD_DIM]
    for i in range(first, last):
        block = tl.load(block_tables_ptr + seq * max_blocks + i).to(tl.int64)  # physical block
        pos = i * BLOCK_SIZE + r  # [BLOCK_SIZE]: the positions of its keys
        seen = pos < context_len  # [BLOCK_SIZE]: the last block may be partly filled
        at = ((block * BLOCK_SIZE + r) * num_kv_heads + kv_head) * HEAD_DIM  # [BLOCK_SIZE]
        # The tail's rows hold stale values, maybe NaN: never loaded, as 0 * NaN is NaN.
        k = tl.load(k_cache_ptr + at[:, None] + d[None, :], mask=seen[:, None], other=0.0)  # [BLOCK_SIZE, HEAD_DIM]
        v = tl.load(v_cache_ptr + at[:, None] + d[None, :], mask=seen[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_G, BLOCK_SIZE]
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_next = tl.maximum(m, tl.max(scores, axis=1))  # [BLOCK_G]: finite, one key is seen
        carry = tl.exp(m - m_next)  # [BLOCK_G]: rescales what was summed under the old max
        p = tl.exp(scores - m_next[:, None])  # [BLOCK_G, BLOCK_SIZE], each at most 1
        l = l * carry + tl.sum(p, axis=1)
        acc = acc * carry[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_next
    # Every split writes its row, an empty one too (m = -inf, l = 0, acc = 0): the merge reads them all.
    row = (seq * num_kv_heads * GROUP + heads) * num_splits + split  # [BLOCK_G]
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=real[:, None])
    tl.store(part_m_ptr + row, m, mask=real)
    tl.store(part_l_ptr + row, l, mask=real)
    # END SOLUTION


@triton.jit
def _merge_kernel(
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM] float32
    part_m_ptr,  # [num_seqs, num_heads, num_splits] float32
    part_l_ptr,  # [num_seqs, num_heads, num_splits] float32
    out_ptr,  # [num_seqs, num_heads, HEAD_DIM]
    num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)  # this (sequence, head)
    s = tl.arange(0, BLOCK_S)  # [BLOCK_S]: the splits, padded to a power of two
    d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    live = s < num_splits  # [BLOCK_S]
    # BEGIN SOLUTION ch09 merge_pass
    m = tl.load(part_m_ptr + row * num_splits + s, mask=live, other=float("-inf"))  # [BLOCK_S]
    l = tl.load(part_l_ptr + row * num_splits + s, mask=live, other=0.0)  # [BLOCK_S]
    acc = tl.load(part_acc_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=live[:, None], other=0.0)  # [BLOCK_S, HEAD_DIM]
    # Each split's sums, carried to the largest max; a split without keys weighs e^-inf = 0.
    weight = tl.exp(m - tl.max(m, axis=0))  # [BLOCK_S]
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)  # [HEAD_DIM]
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))
    # END SOLUTION


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, num_splits: int = 4,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over each sequence's cached keys. q: [num_seqs, num_heads,
    head_dim], one query per sequence; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32; context_lens:
    [num_seqs] int32, each at least 1. Every tensor contiguous; head_dim and block_size
    powers of two. Writes ``out`` (q's shape and dtype) when given; returns it."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads  # query heads per K/V head
    contiguous = all(t.is_contiguous() for t in (q, k_cache, v_cache, block_tables, context_lens))
    if num_heads % num_kv_heads or head_dim & (head_dim - 1) or block_size & (block_size - 1) or not contiguous:
        raise ValueError(f"need whole GQA groups, powers of two and contiguous tensors, got {q.shape}, {k_cache.shape}")
    part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_acc, part_m, part_l, scale, block_tables.shape[1],
        GROUP=group_size, BLOCK_G=max(16, triton.next_power_of_2(group_size)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
    )
    out = q.new_empty(q.shape) if out is None else out
    _merge_kernel[(num_seqs, num_heads)](
        part_acc, part_m, part_l, out, num_splits, HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out
