# Exercise copy of minivllm/kernels/flash_decode.py, generated from it by scripts/make_exercises.py.
# Fill in: _split_kernel (ch09), _merge_kernel (ch09).
# Grade: make grade CH=09
# Running the generator again overwrites this file: commit or copy your work first.

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
    raise NotImplementedError(
        "ch09: split_pass, stage 1 of the two-stage kernel: this program holds one sequence's "
        "query as one row per query head of a K/V group (q) and owns one split of the sequence's "
        "cache blocks. Cut the blocks its context fills into num_splits runs of equal length, "
        "rounded up, and take the split-th (the last runs may be short or empty). Keep, per row, "
        "m, the largest score so far, l, the sum of the exponentials of the scores minus m, and "
        "acc, the values weighted by those exponentials (m starts at minus infinity, l and acc at "
        "zero). Walk the split's blocks in order: the sequence's row of the block table names the "
        "physical block behind each logical one, and the cache's shape (see the pointer comments) "
        "says where that block's keys and values for this K/V head lie. Score the block's keys "
        "against q, times the scale. Why subtract a max at all: e to a score of a few hundred "
        "overflows float32, while e to a score minus the largest is at most 1. When a block raises "
        "the max, whatever was summed under the old max is carried over by e to the (old max minus "
        "new max), in l and in acc alike, before the block's own exponentials are added. The last "
        "block may be partly filled: keys at or past the context length belong to no one (stale "
        "values, maybe NaN), so they must weigh exactly nothing, a score of minus infinity, and "
        "must not even be loaded, as 0 times NaN is NaN. At the end store m, l and acc, "
        "unnormalised, for every real head row (an empty split too: the merge reads every split) "
        "at its (sequence, head, split) row of the partial buffers. Second hint: the block offsets "
        "are int64 (a large pool passes 2 to the 31 elements); both products are tl.dot, the "
        "second with the exponentials cast to the values' dtype; a [rows] vector meets a [rows, "
        "keys] tile only once it has a keys axis of its own, see notebooks/09_triton_kernels.ipynb"
    )


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
    raise NotImplementedError(
        "ch09: merge_pass, stage 2: one program per (sequence, query head) reads the m, l and acc "
        "that each of the num_splits splits left for it (lanes past num_splits are padding: load "
        "them as a split without keys). Each split's l and acc are sums relative to its own max. "
        "Carry every split to the largest max among them, weighing it by e to the (its max minus "
        "the largest): at most 1, and zero for a split without keys, whose max is minus infinity. "
        "The output is the weighted sum of the accumulators over the weighted sum of the l, stored "
        "in the output's dtype. Pitfalls: e to a max itself overflows once scores reach the "
        "hundreds; a split normalised before the merge, then divided by the sums again, counts its "
        "l twice, see notebooks/09_triton_kernels.ipynb"
    )


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
