# Exercise copy of minivllm/kernels/paged_attention.py, generated from it by scripts/make_exercises.py.
# Fill in: _online_softmax_update (ch09), _attend_cached_keys (ch09), _store_split (ch09), _merge_kernel (ch09).
# Grade: make grade CH=09
# Running the generator again overwrites this file: commit or copy your work first.

"""Attention over the paged KV cache: a split-context kernel (decode, short prefill) and a prefill kernel.
  decode (memory-bound): bytes 2 * context * kv_heads * head_dim * dtype_size, FLOPs 4 * context * heads * head_dim
  prefill (compute-bound): FLOPs 2 * q_len * kv_len * heads * head_dim (causal); q, out, K/V per query tile (L2)

Both read keys and values through block tables, token j of sequence b living at row
j % block_size of block block_tables[b, j // block_size], and both use the online softmax
(FlashAttention): scores are consumed tile by tile with a running max m, running sum l and
a rescaled accumulator, so the [queries x keys] matrix never exists in memory. Every tile
is folded in by one helper, ``_online_softmax_update``, in base 2 (exp2 of the scores times
scale * log2(e)).

The split-context kernel (``_decode_kernel``) serves a decode step (DECODE: one query per
sequence, a query tile of height BLOCK_Q = 1) and a short prefill (up to BLOCK_Q queries per
sequence, causal among themselves: a verifying step of speculative decoding), both switches
compile-time constants, so each variant compiles to its own code. One program handles one
(sequence, K/V head, split of the context); its rows are the sequence's queries times all
the query heads of the GQA group, so each loaded K/V tile serves them all. Each sequence
cuts its own cached keys into the grid's splits (so a short context is spread too); the
step's own keys are not in the cache yet: the kernel takes them from the step's K and V and
stores them at their slots (the KV store, fused): in a decode step (NEW_KV) the split that
holds the newest key folds it in, in a short prefill split 0 folds them all in. With one
split the kernel writes the output; otherwise each split writes a partial output and its
log-sum-exp, and ``_merge_kernel`` combines them. A split with no keys (a short context in a
grid sized for a long one) writes only its log-sum-exp, -inf, and the merge skips it.

The prefill kernel: one program handles BLOCK_M query positions of one sequence for all the
query heads of one KV group (a [BLOCK_M * group, head_dim] tile) and walks the keys up to
its causal limit: first the tiles every query sees, without a mask, then the few on the
diagonal, masked. Cached prefix tokens are just more keys. The last query tiles (the most
keys) are launched first, and the block table is read once per cache block of a key tile,
a tile ahead of the loads that need it. Each K/V tile is read once per query tile, mostly
from L2: 2 * kv_len * num_kv_heads * head_dim * dtype_size * cdiv(q_len, BLOCK_M) / 2 bytes.

A float8 cache (chapter 20) holds k / k_scale and v / v_scale, one scale per layer for each.
Every kernel loads its tiles as they are and converts them in registers to float16, the
query with them (``attention_input``: e4m3 to float16 is one instruction per two
elements, exact), and never multiplies a key or a value
by its scale: q . (k_scale * k) = k_scale * (q . k), so k_scale joins the softmax scale,
one multiply per program; and sum_j p_j * (v_scale * v_j) = v_scale * sum_j p_j * v_j, so
v_scale multiplies the output once, at the end. The step's own keys and values, which the
kernels take from the step's K and V rather than the cache, are rounded to what the cache
holds (``quantize_kv``) before they are used, so that every key is attended as the cache
holds it and the scales fold the same way for all of them. With any other cache the scales
are 1.0 and never read.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.common import dot_precision
from minivllm.kernels.kv_store import attention_input, kv_scales, load_kv_scale, quantize_kv, value_offsets
from minivllm.kernels.pdl import pdl_options, wait_for_previous


# exp(x) = 2^(x * log2(e)): the kernels fold log2(e) into the softmax scale and call exp2,
# the GPU's native exponential (one instruction, where exp is a multiply and then exp2).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _online_softmax_update(m, l, acc, s, v, qk_scale, PRECISION: tl.constexpr):
    """Fold one tile into the running softmax of each row (a query): raw scores s = q . k
    [rows, keys] (-inf where a key is not visible), values v [keys, head_dim]; qk_scale is
    the softmax scale times log2(e), so that 2^(s * qk_scale) = e^(s * scale). m [rows] is
    the running max of s * qk_scale (base-2 units), l [rows] the running sum, acc [rows,
    head_dim] the running weighted values. Returns the new (m, l, acc)."""
    raise NotImplementedError(
        "ch09: online softmax, part 1, in base 2: s holds raw scores, one row per query head and "
        "one column per key of the tile; qk_scale is the softmax scale times log2(e), so 2 to the "
        "power score times qk_scale equals e to the power score times scale. Per row, keep m, the "
        "running maximum of the scaled scores, and l, the running sum of exponentials taken "
        "relative to m. With this tile: the new maximum covers m and the tile's scores; alpha, the "
        "factor that carries what was summed under the old maximum over to the new one; p, the "
        "tile's exponentials relative to the new maximum; l, the carried sum plus the row sums of "
        "p. Pitfalls: a row that has seen no visible key yet still has a maximum of minus "
        "infinity, and minus infinity minus minus infinity is NaN, so shift such a row by 0 "
        "instead; m is one value per row while s is a [rows, keys] tile: subtracting a [rows] "
        "vector from a [rows, keys] tile is a shape error in Triton until the vector gets a keys "
        "axis of its own, see notebooks/09_triton_kernels.ipynb"
    )
    raise NotImplementedError(
        "ch09: online softmax, part 2: acc holds, per row, the sum of the values weighted by "
        "exponentials relative to the old maximum. Carry it over to the new maximum (alpha: one "
        "factor per row, broadcast over head_dim), then add this tile's p times v. tl.dot takes an "
        "accumulator as its third argument, which the tensor cores add for free; p goes into the "
        "dot in v's dtype, and the kernel's PRECISION is the dot's input precision. Pitfall: "
        "leaving out the carry-over is exact while the maximum stays put, and wrong as soon as it "
        "moves, see notebooks/09_triton_kernels.ipynb"
    )
    return m_new, l, acc


# -- the split-context kernel: decode and short prefill ------------------------------------


@triton.jit
def _split_key_range(seen, num_keys, window, split, BLOCK_N: tl.constexpr):
    """This program's share of a sequence's cached keys 0 .. num_keys - 1: (first, start,
    end), keys [start, end) in whole BLOCK_N tiles (the last split's end excepted), keys
    before ``first`` hidden. ``seen``: how many keys the first query sees without a window
    (its position + 1); a sliding window (window > 0) hides every key before seen - window,
    and the splits share the visible keys only, from the tile that holds the first."""
    first = tl.maximum(tl.where(window > 0, seen - window, 0), 0)
    lo = first // BLOCK_N * BLOCK_N
    # Each sequence cuts its own keys into the grid's splits: a short context in a grid
    # sized for max_context_len (a CUDA graph's) is spread over several programs of one
    # tile each, not walked by the first split alone.
    partition = tl.cdiv(tl.cdiv(num_keys - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = lo + split * partition
    end = tl.minimum(start + partition, num_keys)
    return first, start, end


@triton.jit
def _query_tile(q_ptr, q_start, q_len, kv_head, stride_qt, stride_qh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, DECODE: tl.constexpr):
    """The program's query rows, BLOCK_Q positions (from token q_start of q, q_len of them
    real; DECODE: one, token q_start) x the BLOCK_G heads of one KV group, position major:
    (q [rows, HEAD_DIM], token (each row's token in q; DECODE: the scalar q_start), heads,
    qi (each row's position among the sequence's queries), row_valid)."""
    if DECODE:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        token = q_start
        qi = tl.zeros([BLOCK_G], tl.int32)  # the sequence's one query
        row_valid = g < GROUP
        q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < GROUP,
                    other=0.0)
    else:
        r = tl.arange(0, BLOCK_Q * BLOCK_G)
        qi = r // BLOCK_G
        g = r % BLOCK_G
        heads = kv_head * GROUP + g
        d = tl.arange(0, HEAD_DIM)
        token = q_start + qi
        row_valid = (qi < q_len) & (g < GROUP)
        q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=row_valid[:, None], other=0.0)
    return q, token, heads, qi, row_valid


@triton.jit
def _attend_cached_keys(m, l, acc, q, q_pos, k_cache_ptr, v_cache_ptr, bt_ptr, first, start, end, last_block,
                        kv_head, stride_cb, stride_cs, stride_ch, window, scale,
                        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr, DECODE: tl.constexpr):
    """Fold the cached keys [start, end) of one sequence and K/V head into the running
    softmax of the query rows q (at positions q_pos), a tile of BLOCK_N keys at a time, read
    in place through the block table (bt_ptr), in q's dtype (a float8 cache's: ``scale``
    holds its k_scale, and acc is in units of its v_scale). Returns the new (m, l, acc)."""
    raise NotImplementedError(
        "ch09: the paged key loop: walk the keys start to end, BLOCK_N at a time. A key of the "
        "tile is valid when it lies in the range and is not before first; _kv_tile_rows gives each "
        "key's row in the cache through the block table. Load the tile's keys (invalid ones as "
        "zeros), score them against q with a dot, hide what each query may not see (DECODE: only "
        "the invalid keys; otherwise also the rows of padding queries, negative q_pos, and with a "
        "window the keys at or before a query's position minus the window) as minus infinity, load "
        "the values with _load_values (it knows how the cache lays values out: chapter 20 changes "
        "it) and fold the tile in with _online_softmax_update, scale times LOG2E as its scale. "
        "Return the running state. Pitfall: a masked key loaded as zero still scores zero, not "
        "minus infinity, see notebooks/09_triton_kernels.ipynb"
    )


@triton.jit
def _cache_rows(slot, head_off, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64) of cache slot(s) ``slot`` of one K/V head (head_off)."""
    return (slot // BLOCK_SIZE).to(tl.int64) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head_off


@triton.jit
def _attend_newest_key(m, l, acc, q, k_new_ptr, v_new_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, b, kv_head, split,
                       newest, start, end, head_off, stride_cb, stride_cs, stride_ch, stride_knt, stride_knh,
                       stride_vnt, stride_vnh, qk_scale, k_scale, v_scale, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """A decode step's own key and value (position ``newest``, not in the cache yet): the
    program whose keys [start, end) hold it folds it into the running softmax from
    registers, as the cache holds them (k_scale, v_scale: a float8 cache's), and split 0
    stores it at its slot (-1: a padding row, nothing to store). Returns the new (m, l, acc)."""
    d = tl.arange(0, HEAD_DIM)
    k_new = quantize_kv(tl.load(k_new_ptr + b * stride_knt + kv_head * stride_knh + d), k_scale, k_cache_ptr)
    v_new = quantize_kv(tl.load(v_new_ptr + b * stride_vnt + kv_head * stride_vnh + d), v_scale, v_cache_ptr)
    if (start <= newest) & (newest < end):
        # One key: a row sum rather than a dot (tensor-core tiles are at least 16 keys wide).
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s_new - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new
    slot = tl.load(slot_ptr + b)
    if (split == 0) & (slot >= 0):
        row = _cache_rows(slot, head_off, stride_cb, stride_cs, BLOCK_SIZE)
        tl.store(k_cache_ptr + row + d, k_new)
        tl.store(v_cache_ptr + value_offsets(slot, kv_head, d, stride_cb, stride_cs, stride_ch, v_cache_ptr, HEAD_DIM,
                                             BLOCK_SIZE), v_new)
    return m, l, acc


@triton.jit
def _attend_step_keys(m, l, acc, q, qi, k_new_ptr, v_new_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_start, q_len,
                      kv_head, head_off, stride_cb, stride_cs, stride_ch, stride_knt, stride_knh, stride_vnt,
                      stride_vnh, window, qk_scale, k_scale, v_scale, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_QK: tl.constexpr, PRECISION: tl.constexpr):
    """A short prefill's own keys and values (tokens q_start .. q_start + q_len - 1 of the
    step, not in the cache yet), for split 0: folded into the running softmax of the query
    rows (each at position qi among them: causal) as the cache holds them (k_scale, v_scale:
    a float8 cache's), and stored at their slots (-1: nothing to store). No program reads
    those slots, so nothing waits for the store. Returns the new (m, l, acc)."""
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, BLOCK_QK)
    j_valid = j < q_len
    k_new = tl.load(k_new_ptr + (q_start + j)[:, None] * stride_knt + kv_head * stride_knh + d[None, :],
                    mask=j_valid[:, None], other=0.0)  # [BLOCK_QK, HEAD_DIM]
    v_new = tl.load(v_new_ptr + (q_start + j)[:, None] * stride_vnt + kv_head * stride_vnh + d[None, :],
                    mask=j_valid[:, None], other=0.0)
    k_new = quantize_kv(k_new, k_scale, k_cache_ptr)  # as the cache holds them
    v_new = quantize_kv(v_new, v_scale, v_cache_ptr)
    s = tl.dot(q, tl.trans(k_new.to(q.dtype)), input_precision=PRECISION)  # [rows, BLOCK_QK]
    visible = j_valid[None, :] & (j[None, :] <= qi[:, None])
    if window > 0:
        visible = visible & (j[None, :] > qi[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m, l, acc = _online_softmax_update(m, l, acc, s, v_new.to(q.dtype), qk_scale, PRECISION)
    slot = tl.load(slot_ptr + q_start + j, mask=j_valid, other=-1)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)
    dst = _cache_rows(slot, head_off, stride_cb, stride_cs, BLOCK_SIZE)
    tl.store(k_cache_ptr + dst[:, None] + d[None, :], k_new, mask=keep[:, None])
    v_dst = value_offsets(slot[:, None], kv_head, d[None, :], stride_cb, stride_cs, stride_ch, v_cache_ptr, HEAD_DIM,
                          BLOCK_SIZE)
    tl.store(v_cache_ptr + v_dst, v_new, mask=keep[:, None])
    return m, l, acc


@triton.jit
def _store_empty_split(part_lse_ptr, q_start, q_len, kv_head, split, stride_lt, stride_lh, GROUP: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, DECODE: tl.constexpr):
    """A split with no keys: the log-sum-exp of each of its rows is -inf (no partial output
    is stored; the merge reads none where the log-sum-exp is -inf)."""
    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    qi = r // BLOCK_G
    g = r % BLOCK_G
    token = q_start if DECODE else q_start + qi
    row_valid = (qi < q_len) & (g < GROUP)
    tl.store(part_lse_ptr + token * stride_lt + (kv_head * GROUP + g) * stride_lh + split,
             tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32), mask=row_valid)


@triton.jit
def _store_split(part_out_ptr, part_lse_ptr, m, l, acc, token, heads, split, row_valid, stride_pt, stride_ph,
                 stride_ps, stride_lt, stride_lh, HEAD_DIM: tl.constexpr, DIRECT: tl.constexpr):
    """The epilogue: normalise the rows' running softmax (a row with no keys gives zeros)
    and store it, as the output itself in its dtype (DIRECT: one split, no merge to launch)
    or as this split's float32 partial output and log-sum-exp, for ``_merge_kernel``."""
    raise NotImplementedError(
        "ch09: _store_split: normalise each row's accumulator by its running sum; a row that saw "
        "no key has a sum of zero and must give zeros, not NaN. DIRECT (one split): store the "
        "output in the output's dtype. Otherwise store the float32 partial output and the row's "
        "natural log-sum-exp, ln of 2 to the m times l (m is in base 2), minus infinity for a row "
        "without keys, for the merge. Only valid rows are stored. Pitfall: m is a base-2 maximum, "
        "see notebooks/09_triton_kernels.ipynb"
    )


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]: one query per sequence (DECODE), or a few (cu_seqlens)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32: keys per sequence after this step, its own included
    cu_seqlens_ptr,  # [num_seqs + 1] int32: where each sequence's queries start in q (not read with DECODE)
    part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] float32; with DIRECT, the output
    part_lse_ptr,  # [num_tokens, num_heads, num_splits] float32 (not read with DIRECT)
    k_new_ptr,  # [num_tokens, num_kv_heads, head_dim]: the step's own keys (read with NEW_KV)
    v_new_ptr,  # [num_tokens, num_kv_heads, head_dim]: its values, likewise
    slot_ptr,  # [num_tokens]: where they go in the cache, -1 for a padding row (NEW_KV)
    k_scale_ptr, v_scale_ptr,  # [1] float32: a float8 cache's scales (not read otherwise)
    scale,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    DIRECT: tl.constexpr, NEW_KV: tl.constexpr, DECODE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_QK: tl.constexpr = 16,
):
    # The step's metadata (lengths, cu_seqlens) was copied in before its first kernel: this
    # program's key range is worked out before waiting for the kernel before, which wrote q.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        # Decode: sequence b's one query is row b of q, at position num_keys - 1, the newest
        # key. With NEW_KV that key and its value are not in the cache yet: the program whose
        # split holds it takes them from registers, so no program reads that row.
        q_start = b
        q_len = 1
        # int32 whatever the metadata's dtype (an eager step's and a graph's are int64): the
        # key loop's index arithmetic in int64 costs the kernel about a tenth of its time.
        num_keys = tl.load(context_lens_ptr + b).to(tl.int32)
        first, start, end = _split_key_range(num_keys, num_keys, window, split, BLOCK_N)
    else:
        # A short prefill: sequence b's q_len queries (cu_seqlens) follow its cached keys,
        # which every query sees (a sliding window aside): the splits share those, from the
        # tile that holds the first key the first query's window shows. Split 0 takes the
        # step's own keys below (NEW_KV always).
        q_start = tl.load(cu_seqlens_ptr + b).to(tl.int32)
        q_len = tl.load(cu_seqlens_ptr + b + 1).to(tl.int32) - q_start
        # (Waiting before a padding program ends: a kernel whose every program skipped the
        # wait could finish before the kernel before it, and the kernel after would not wait.)
        wait_for_previous(USE_PDL)
        if q_len == 0:
            return  # a padding sequence (a CUDA graph's): no queries, no keys
        num_keys = tl.load(context_lens_ptr + b).to(tl.int32) - q_len  # those cached before this step
        first, start, end = _split_key_range(num_keys + 1, num_keys, window, split, BLOCK_N)
    if DECODE:
        wait_for_previous(USE_PDL)
    if not DIRECT:
        if (split > 0) & (start >= end):
            # No keys for this split (a context shorter than the grid was sized for): only
            # its log-sum-exp is stored, -inf, and the merge skips its partial output.
            _store_empty_split(part_lse_ptr, q_start, q_len, kv_head, split, stride_lt, stride_lh, GROUP, BLOCK_G,
                               BLOCK_Q, DECODE)
            return
    q, token, heads, qi, row_valid = _query_tile(q_ptr, q_start, q_len, kv_head, stride_qt, stride_qh,
                                                 GROUP, BLOCK_G, HEAD_DIM, BLOCK_Q, DECODE)
    q = attention_input(q, k_cache_ptr)  # a float8 cache's tiles are taken in float16
    m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, HEAD_DIM], tl.float32)
    bt_ptr = block_tables_ptr + b * stride_bt
    last_block = tl.maximum(num_keys - 1, 0) // BLOCK_SIZE
    # The first query's position: a decode step's newest key, a short prefill's first own key.
    q_pos0 = num_keys - 1 if DECODE else num_keys
    cache_end = tl.minimum(end, q_pos0) if DECODE and NEW_KV else end
    # A float8 cache's scales fold into the softmax scale (keys) and the output (values).
    k_scale = load_kv_scale(k_scale_ptr, k_cache_ptr)
    v_scale = load_kv_scale(v_scale_ptr, v_cache_ptr)
    m, l, acc = _attend_cached_keys(m, l, acc, q, q_pos0 + qi, k_cache_ptr, v_cache_ptr, bt_ptr, first, start,
                                    cache_end, last_block, kv_head, stride_cb, stride_cs, stride_ch, window,
                                    scale * k_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, DECODE)
    head_off = kv_head * stride_ch
    qk_scale = scale * k_scale * LOG2E
    if DECODE:
        if NEW_KV:
            m, l, acc = _attend_newest_key(m, l, acc, q, k_new_ptr, v_new_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                                           b, kv_head, split, q_pos0, start, end, head_off, stride_cb, stride_cs,
                                           stride_ch, stride_knt, stride_knh, stride_vnt, stride_vnh, qk_scale, k_scale,
                                           v_scale, HEAD_DIM, BLOCK_SIZE)
    else:
        if split == 0:
            m, l, acc = _attend_step_keys(m, l, acc, q, qi, k_new_ptr, v_new_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                                          q_start, q_len, kv_head, head_off, stride_cb, stride_cs, stride_ch,
                                          stride_knt, stride_knh, stride_vnt, stride_vnh, window, qk_scale, k_scale, v_scale,
                                          HEAD_DIM, BLOCK_SIZE, BLOCK_QK, PRECISION)
    # Every value went in as the cache holds it (v / v_scale): one multiply gives them back.
    acc = acc * v_scale
    _store_split(part_out_ptr, part_lse_ptr, m, l, acc, token, heads, split, row_valid, stride_pt, stride_ph,
                 stride_ps, stride_lt, stride_lh, HEAD_DIM, DIRECT)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    smask = s < num_splits
    raise NotImplementedError(
        "ch09: the merge: each split of a (sequence, head) left a normalised partial output and "
        "its log-sum-exp. The exact output weights each partial by the exponential of its lse, "
        "relative to the largest lse for range, over the sum of those weights. Splits past "
        "num_splits and splits with no keys (lse minus infinity) weigh nothing, and a split with "
        "no keys stored no partial output: load none there. A row with no keys at all gives zeros. "
        "Pitfall: weighting by the lse itself instead of its exponential, see "
        "notebooks/09_triton_kernels.ipynb"
    )


def sm_count(x: torch.Tensor) -> int:
    """Multiprocessors of x's GPU (132 on an H200); 4 off the GPU, where the interpreter runs
    the kernels and only the plan's shape matters."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4


SPLIT_PROGRAMS_PER_SM = 12


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int = 132) -> int:
    """How many programs share each sequence's keys: enough for about twelve programs per
    multiprocessor (SPLIT_PROGRAMS_PER_SM), but no split shorter than 256 tokens of
    ``max_context_len``. The contexts of a batch differ in length, and with one program per
    (sequence, K/V head) the GPU ends up waiting for the longest. (From
    scripts/tune_attention.py's decode sweep; history in benchmarks/attention_tuning.md.)"""
    want = triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context_len, 256)))


def decode_config(head_dim: int, dtype_size: int = 2) -> dict:
    """Tile shape of the decode kernel: BLOCK_N keys per step (a K/V tile of [BLOCK_N,
    head_dim] is at most 32 KB: 128 keys for bf16 heads of 128), and the launch's warps and
    pipeline stages. Heads wider than 128 (Gemma 3's, Qwen3.5's 256) keep the 32-key tiles
    they were tested with. (Tiles from scripts/tune_attention.py's decode sweep; history in
    benchmarks/attention_tuning.md.)"""
    block_n = min(128, 32768 // (head_dim * dtype_size)) if head_dim <= 128 else 32
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3}


def _check_heads(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Every launcher's shape rule: whole KV groups, and a power-of-two head_dim (the kernels'
    tl.arange over it)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or head_dim & (head_dim - 1):
        raise ValueError(f"need num_heads % num_kv_heads == 0 and a power-of-two head_dim, got {q.shape}, {k_cache.shape}")


def _check_step_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, rows: str, shape: tuple) -> None:
    """The step's own keys and values as the split-context kernel reads them: ``shape``
    ([rows, num_kv_heads, head_dim]) with contiguous head_dim, and one slot per row."""
    if (k.shape != shape or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1
            or slot_mapping.shape != shape[:1]):
        raise ValueError(f"k and v must be [{rows}, num_kv_heads, head_dim] = {shape} "
                         f"with contiguous head_dim, slot_mapping [{rows}]; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(slot_mapping.shape)}")


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
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim] (one query per sequence). Returns the same shape.
    With ``sliding_window`` each query sees only the last sliding_window keys. ``config``:
    the tile shape (``decode_config``'s keys), for tuning.

    With ``k``, ``v`` ([num_seqs, num_kv_heads, head_dim]) and ``slot_mapping`` the step's
    own keys and values are not in the cache yet: the kernel stores each at its slot (-1:
    nothing to store) and attends over it as the sequence's newest key (context_lens count
    it). Without them the cache must hold every key already.

    ``max_context_len`` bounds the context lengths (it sizes the splits; under a CUDA graph
    it is the engine's max_model_len, since the real lengths change at every replay).
    ``k_scale``, ``v_scale`` (float32, one element each): a float8 cache's scales.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    _check_heads(q, k_cache)
    if num_seqs and max_context_len < 1:
        # Checked on the host: the number of splits is sized from it.
        raise ValueError(f"max_context_len must bound every sequence's context length (>= 1), got {max_context_len}")
    if not scale > 0:
        # The online softmax takes each row's max of the raw scores before scaling them.
        raise ValueError(f"scale must be > 0, got {scale}")
    if num_splits is None:
        sms = sm_count(q)
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context_len, sms)
    new_kv = k is not None
    if new_kv != (v is not None) or new_kv != (slot_mapping is not None):
        raise ValueError("give k, v and slot_mapping together, or none of them")
    if new_kv:
        _check_step_kv(k, v, slot_mapping, "num_seqs", (num_seqs, num_kv_heads, head_dim))
    config = {**decode_config(head_dim, k_cache.element_size()), **(config or {})}
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    k_new, v_new, slots = (k, v, slot_mapping) if new_kv else (q, q, context_lens)  # unread stand-ins
    return _split_context_attention(
        (num_seqs, num_kv_heads, num_splits), q, k_cache, v_cache, block_tables, context_lens, context_lens,
        k_new, v_new, slots, out, scale, sliding_window, config, k_scale, v_scale,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_Q=1, NEW_KV=new_kv, DECODE=True)


def _split_context_attention(grid, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens, k, v, slots, out,
                             scale, sliding_window, config, k_scale, v_scale, **tile) -> torch.Tensor:
    """Launch ``_decode_kernel`` on ``grid`` (num_seqs, num_kv_heads, num_splits) and merge
    its splits into ``out``: with one split (a large batch) the kernel writes the output
    itself; otherwise each split writes its partial output and log-sum-exp, and the merge
    combines them. ``tile``: the kernel's variant (DECODE, NEW_KV) and query tile (BLOCK_G,
    BLOCK_Q, BLOCK_QK); ``k_scale``, ``v_scale``: a float8 cache's scales."""
    part_out, part_lse = split_buffers(out, grid[2])
    k_scale, v_scale = kv_scales(k_cache, v_cache, k_scale, v_scale)
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens, part_out, part_lse, k, v, slots, k_scale, v_scale,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        sliding_window or 0,
        GROUP=q.shape[1] // k_cache.shape[2], HEAD_DIM=q.shape[2], BLOCK_SIZE=k_cache.shape[1],
        PRECISION=dot_precision(q.dtype), DIRECT=grid[2] == 1, **tile, **pdl_options(q), **config,
    )
    return merge_splits(part_out, part_lse, out)


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the splits of a split-context kernel write, for ``out`` ([rows, num_heads,
    head_dim]): with one split, ``out`` itself seen as [rows, num_heads, 1, head_dim] (the
    kernel's DIRECT store; the second tensor is an unread stand-in); otherwise float32
    partial outputs [rows, num_heads, num_splits, head_dim] and their log-sum-exps [rows,
    num_heads, num_splits]."""
    if num_splits == 1:
        return out.unsqueeze(2), out
    rows, num_heads, head_dim = out.shape
    return (torch.empty(rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=out.device),
            torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=out.device))


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Combine ``split_buffers``' partials into ``out`` by log-sum-exp; nothing to do after
    one split, which the kernel wrote into ``out`` directly. Returns ``out``."""
    rows, num_heads, num_splits, head_dim = part_out.shape
    if num_splits == 1:
        return out
    _merge_kernel[(rows, num_heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        # At least 16 split slots: one compiled merge serves every count up to 16 (a CUDA graph's
        # at max_model_len 4,096, and an eager step's up to that context).
        num_splits, HEAD_DIM=head_dim, BLOCK_S=max(16, triton.next_power_of_2(num_splits)), **pdl_options(out),
    )
    return out


@triton.jit
def _kv_tile_rows(bt_ptr, n0, last_block, head_off, stride_cb, stride_cs,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PER_BLOCK: tl.constexpr):
    """Element offsets [BLOCK_N] (int64) of the cache rows of keys n0 .. n0 + BLOCK_N - 1 of one
    K/V head (head_off), through one sequence's block table (bt_ptr). n0 is a multiple of
    BLOCK_N. Block indices past the sequence's last block are clamped to it (the rows stay in
    the pool; the caller masks keys it must not see)."""
    if PER_BLOCK and BLOCK_SIZE % BLOCK_N == 0:
        # The whole tile lies in one cache block: one block id, then BLOCK_N consecutive rows.
        block = tl.load(bt_ptr + tl.minimum(n0 // BLOCK_SIZE, last_block)).to(tl.int64)
        rows = (n0 % BLOCK_SIZE) + tl.arange(0, BLOCK_N)
        return block * stride_cb + rows * stride_cs + head_off
    elif PER_BLOCK and BLOCK_N % BLOCK_SIZE == 0 and ((BLOCK_N // BLOCK_SIZE) & (BLOCK_N // BLOCK_SIZE - 1)) == 0:
        # The tile spans whole cache blocks: one id per block, BLOCK_SIZE consecutive rows each.
        j = n0 // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        blocks = tl.load(bt_ptr + tl.minimum(j, last_block)).to(tl.int64)
        offs = blocks[:, None] * stride_cb + tl.arange(0, BLOCK_SIZE)[None, :] * stride_cs
        return tl.reshape(offs, [BLOCK_N]) + head_off
    else:
        # Any block size: each key's block id.
        n = n0 + tl.arange(0, BLOCK_N)
        block = tl.load(bt_ptr + tl.minimum(n // BLOCK_SIZE, last_block)).to(tl.int64)
        return block * stride_cb + (n % BLOCK_SIZE) * stride_cs + head_off


@triton.jit
def _load_values(v_cache_ptr, rows, d, valid, bt_ptr, n0, last_block, head_off, stride_cb, stride_cs,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The values [BLOCK_N, HEAD_DIM] of the keys whose cache rows are ``rows`` (element
    offsets of one K/V head's rows, as ``_kv_tile_rows`` gives them for the tile of keys
    n0 .. n0 + BLOCK_N - 1 through the block table bt_ptr, head_off that K/V head's offset
    in a row), keys not ``valid`` as zeros (valid None: all). A float8 cache's values are
    key-contiguous (kv_store.py): one K/V head's values in a block are one run of
    HEAD_DIM * BLOCK_SIZE bytes, read whole, a block a row (its id looked up again, clamped
    to last_block as the rows are), and rearranged in registers (or, a tile within one
    block, read as [HEAD_DIM, BLOCK_N] and transposed); they are read unmasked (a float8
    pool holds finite values only, and an invisible key's weight is exactly 0)."""
    NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
    HEAD_DIM: tl.constexpr = d.shape[0]
    if (v_cache_ptr.dtype.element_ty == tl.float8e4nv and NB > 1 and BLOCK_N % BLOCK_SIZE == 0
            and (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0):
        # Read as [HEAD_DIM, BLOCK_N], a warp would take 16 keys' bytes of each of eight
        # blocks, and every 32-byte sector was asked for twice: 54% of the copy bandwidth,
        # where whole blocks read at 82% (benchmarks/h100/kv_gather_bb06619.json).
        # One block id a block, looked up again (taking each block's first row from `rows`
        # spilled registers).
        block = tl.load(bt_ptr + tl.minimum(n0 // BLOCK_SIZE + tl.arange(0, NB), last_block)).to(tl.int64)  # [NB]
        chunk = tl.arange(0, HEAD_DIM * BLOCK_SIZE)
        # head_off is the head's offset in a key row (kv_head * HEAD_DIM): in a value block
        # the head's run starts BLOCK_SIZE times further in.
        v = tl.load(v_cache_ptr + (block * stride_cb + head_off * BLOCK_SIZE)[:, None] + chunk[None, :])
        v = tl.reshape(v, [NB, HEAD_DIM, BLOCK_SIZE])
        # [NB, BLOCK_SIZE, HEAD_DIM] -> [BLOCK_N, HEAD_DIM]: row j * BLOCK_SIZE + slot is key
        # n0 + j * BLOCK_SIZE + slot.
        v = tl.reshape(tl.permute(v, (0, 2, 1)), [BLOCK_N, HEAD_DIM])
    elif v_cache_ptr.dtype.element_ty == tl.float8e4nv:
        block_start = rows // stride_cb * stride_cb
        within = rows - block_start  # row * stride_cs + kv_head * HEAD_DIM
        cols = block_start + within % stride_cs * BLOCK_SIZE + within // stride_cs
        RUN: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N
        cols = tl.max_contiguous(tl.multiple_of(cols, RUN), RUN)
        v = tl.trans(tl.load(v_cache_ptr + cols[None, :] + d[:, None] * BLOCK_SIZE))
    elif valid is None:
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :])
    else:
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    return v


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_new,  # with NEW_KV: a descriptor of this step's keys, [num_tokens, num_kv_heads * head_dim]
    v_new,  # with NEW_KV: the same of its values
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32: keys per sequence, cached prefix included
    cu_seqlens_ptr,  # [num_seqs + 1] int32: where each sequence's queries start in q
    out_ptr,  # [num_tokens, num_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [1] float32: a float8 cache's scales (not read otherwise)
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_bt, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr, K_T: tl.constexpr, PER_BLOCK: tl.constexpr, NEW_KV: tl.constexpr,
    FROM_SCRATCH: tl.constexpr = False,
):
    # The last query tiles of a causal prompt have the most keys: launch them first, so that
    # the light ones fill the GPU's tail instead of a heavy one running alone at the end.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
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
    q = attention_input(q, k_cache_ptr)  # a float8 cache's tiles are taken in float16
    q_pos = offset + m_idx
    # A float8 cache's scales fold into the softmax scale (keys) and the output (values).
    k_scale = load_kv_scale(k_scale_ptr, k_cache_ptr)
    v_scale = load_kv_scale(v_scale_ptr, v_cache_ptr)
    qk_scale = scale * k_scale * LOG2E

    bt_ptr = block_tables_ptr + b * stride_bt
    last_block = (kv_len - 1) // BLOCK_SIZE
    head_off = kv_head * stride_ch
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
    # Key tiles wholly at or after `offset` were computed in this step: with NEW_KV they are
    # read from the step's own keys and values, contiguous rows that a tensor descriptor
    # loads in bulk (Hopper's TMA), not gathered row by row through the block table. So
    # [lo, mid) splits at the first such tile into gathered tiles and loaded ones, and so
    # does [mid, hi). A prompt from scratch (offset 0) gathers nothing.
    if NEW_KV:
        step_lo = tl.cdiv(offset, BLOCK_N) * BLOCK_N
        mid_gathered = tl.minimum(tl.maximum(lo, step_lo), mid)
        hi_gathered = tl.minimum(tl.maximum(mid, step_lo), hi)
        if FROM_SCRATCH:
            mid_gathered = lo
            hi_gathered = mid
    else:
        mid_gathered = mid
        hi_gathered = hi
    # FROM_SCRATCH (with NEW_KV): the caller says no sequence has keys before its queries
    # (offset 0 everywhere), so every key tile is the step's own and the gathered loops are
    # not compiled at all.
    if PREFETCH and not FROM_SCRATCH:
        # The block-table lookup runs one tile ahead of the K/V loads that need it, so a load
        # never waits on the lookup of its own addresses.
        rows = _kv_tile_rows(bt_ptr, lo, last_block, head_off, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N, PER_BLOCK)
    if not FROM_SCRATCH:
        for n0 in range(lo, mid_gathered, BLOCK_N):
            n0 = tl.multiple_of(n0, BLOCK_N)
            if not PREFETCH:
                rows = _kv_tile_rows(bt_ptr, n0, last_block, head_off, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N, PER_BLOCK)
            if K_T:
                s = tl.dot(q, tl.load(k_cache_ptr + rows[None, :] + d[:, None]).to(q.dtype), input_precision=PRECISION)
            else:
                s = tl.dot(q, tl.trans(tl.load(k_cache_ptr + rows[:, None] + d[None, :]).to(q.dtype)),
                           input_precision=PRECISION)
            v = _load_values(v_cache_ptr, rows, d, None, bt_ptr, n0, last_block, head_off, stride_cb, stride_cs,
                             BLOCK_SIZE, BLOCK_N).to(q.dtype)
            if PREFETCH:
                rows = _kv_tile_rows(bt_ptr, n0 + BLOCK_N, last_block, head_off, stride_cb, stride_cs, BLOCK_SIZE,
                                     BLOCK_N, PER_BLOCK)
            m, l, acc = _online_softmax_update(m, l, acc, s, v, qk_scale, PRECISION)
    if NEW_KV:
        for n0 in range(mid_gathered, mid, BLOCK_N):
            row = (q_start + n0 - offset).to(tl.int32)  # key n0's row among the step's tokens
            # As the cache holds them: a float8 cache's rounding, in registers.
            k = quantize_kv(k_new.load([row, kv_head * HEAD_DIM]), k_scale, k_cache_ptr)  # [BLOCK_N, HEAD_DIM]
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
            v = quantize_kv(v_new.load([row, kv_head * HEAD_DIM]), v_scale, v_cache_ptr).to(q.dtype)
            m, l, acc = _online_softmax_update(m, l, acc, s, v, qk_scale, PRECISION)
        if PREFETCH and not FROM_SCRATCH:  # the gathered diagonal tiles start at mid, not where the first loop stopped
            rows = _kv_tile_rows(bt_ptr, mid, last_block, head_off, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N,
                                 PER_BLOCK)
    if not FROM_SCRATCH:
        for n0 in range(mid, hi_gathered, BLOCK_N):
            n0 = tl.multiple_of(n0, BLOCK_N)
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < hi
            if not PREFETCH:
                rows = _kv_tile_rows(bt_ptr, n0, last_block, head_off, stride_cb, stride_cs, BLOCK_SIZE, BLOCK_N, PER_BLOCK)
            if K_T:
                k = tl.load(k_cache_ptr + rows[None, :] + d[:, None], mask=valid[None, :], other=0.0).to(q.dtype)
                s = tl.dot(q, k, input_precision=PRECISION)
            else:
                k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            visible = valid[None, :] & (n[None, :] <= q_pos[:, None])
            if window > 0:
                visible = visible & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            v = _load_values(v_cache_ptr, rows, d, valid, bt_ptr, n0, last_block, head_off, stride_cb, stride_cs,
                             BLOCK_SIZE, BLOCK_N).to(q.dtype)
            if PREFETCH:
                rows = _kv_tile_rows(bt_ptr, n0 + BLOCK_N, last_block, head_off, stride_cb, stride_cs, BLOCK_SIZE,
                                     BLOCK_N, PER_BLOCK)
            m, l, acc = _online_softmax_update(m, l, acc, s, v, qk_scale, PRECISION)
    if NEW_KV:
        for n0 in range(hi_gathered, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < hi
            row = (q_start + n0 - offset).to(tl.int32)
            k = quantize_kv(k_new.load([row, kv_head * HEAD_DIM]), k_scale, k_cache_ptr)  # past the step's last: 0
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
            visible = valid[None, :] & (n[None, :] <= q_pos[:, None])
            if window > 0:
                visible = visible & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            # Rows past the sequence's keys are another sequence's, or a graph's padding: zero
            # them, as the gathered loads' mask does, so that nothing but 0 * v reaches the dot.
            v = quantize_kv(v_new.load([row, kv_head * HEAD_DIM]), v_scale, v_cache_ptr).to(q.dtype)
            v = tl.where(valid[:, None], v, 0.0)
            m, l, acc = _online_softmax_update(m, l, acc, s, v, qk_scale, PRECISION)
    # Every value went in as the cache holds it (v / v_scale): one multiply gives them back.
    out = acc * v_scale / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


# The longest query (tokens of one sequence in a step) that gets the short-query tiles.
SHORT_QUERY = 16


def prefill_config(head_dim: int, group: int, on_gpu: bool = True, max_seqlen_q: int | None = None,
                   itemsize: int = 2) -> dict:
    """Tile shape of the prefill kernel: BLOCK_M query positions (times the KV group's heads
    per tile), BLOCK_N keys per step, the launch's warps and pipeline stages, and five
    switches of the kernel (``PREFETCH``: block-table lookups one tile ahead; ``K_T``: keys
    loaded as [head_dim, keys]; ``PER_BLOCK``: one block id per cache block of a tile, not
    per key; ``NEW_KV``: the keys computed in this step read from the step's own K and V
    through tensor descriptors, when the caller passes them; ``FROM_SCRATCH``: the caller
    promises that no sequence has keys before its queries, and the kernel is compiled with
    NEW_KV's loads alone, without the gathered loops, whose presence slows the compiled
    loops even where they never run). On the GPU, tiles from scripts/tune_attention.py
    (history in benchmarks/attention_tuning.md); in the interpreter (CPU tests) small
    tiles, so that short test sequences span several.

    A step whose every sequence computes at most SHORT_QUERY tokens (``max_seqlen_q``: a
    verifying step of speculative decoding, a short prompt) gets tiles of 16 rows, the
    fewest ``tl.dot`` takes: a 128-row tile would hold a 4-token query's 8 rows and compute
    120 rows of padding, against every key of the context.

    Float32 (``itemsize`` 4, the course's parity runs) takes tiles of its own: the
    half-precision ones would not fit in shared memory."""
    block_g = triton.next_power_of_2(group)
    switches = {"PREFETCH": True, "K_T": False, "PER_BLOCK": False, "NEW_KV": True, "FROM_SCRATCH": False}
    if not on_gpu:
        return {"BLOCK_M": max(1, 16 // block_g), "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, **switches}
    if max_seqlen_q is not None and max_seqlen_q <= SHORT_QUERY:
        # NEW_KV off: a tile of 64 keys lies wholly in a short query's own keys only for a
        # prompt of them, and the loads it adds cost compile time and shared memory.
        return {"BLOCK_M": max(1, 16 // block_g), "BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 4,
                "num_stages": 2, **switches, "NEW_KV": False}
    if head_dim <= 128 and itemsize <= 2:
        # The sweep's choice: 64 query rows per tile (positions x the group's heads), 64 keys
        # per step, 4 warps, 3 stages, the block-table lookup a tile ahead, and the step's
        # own keys read through tensor descriptors.
        return {"BLOCK_M": max(1, 64 // block_g), "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, **switches}
    plain = {"PREFETCH": False, "K_T": False, "PER_BLOCK": False, "NEW_KV": False, "FROM_SCRATCH": False}
    if itemsize > 2:
        # Float32 (parity runs, not speed): 64 rows of any group, 32 keys, 2 stages, the
        # plain loads: larger tiles, or NEW_KV's, overflow shared memory at head_dim 256.
        return {"BLOCK_M": max(1, 64 // block_g), "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, **plain}
    # Wider heads (Gemma's 256) keep the shape they were measured with: 16 positions or more
    # (64 rows at a group of 2), 32 keys, 4 warps, 2 stages (a 128-row tile of 256 channels
    # would not leave shared memory for three stages of K and V), and the plain loads.
    return {"BLOCK_M": max(16, 64 // block_g), "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, **plain}


def step_kv_descriptor(x: torch.Tensor | None, cache: torch.Tensor, block_n: int):
    """A tensor descriptor of one step's keys (or values) x, [num_tokens, num_kv_heads,
    head_dim], seen as [num_tokens, num_kv_heads * head_dim] and loaded [block_n, head_dim]
    at a time; None where x is missing, empty, or laid out so that a descriptor cannot
    address it (a token's heads not contiguous, rows not 16-byte aligned, another dtype
    than the cache's, a float8 cache's aside: the kernel rounds those keys to float8 in
    registers): the kernel then reads those keys from the cache."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    if x is None or x.shape[0] == 0 or (x.dtype != cache.dtype and not fp8) or x.shape[1:] != cache.shape[2:]:
        return None
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = torch.as_strided(x, (tokens, heads * head_dim), (x.stride(0), 1))
    return TensorDescriptor(rows, shape=list(rows.shape), strides=list(rows.stride()), block_shape=[block_n, head_dim])


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
    out: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], packed sequences (cu_seqlens_q); their keys and
    values, cached prefix included, are already in the cache. Causal, and with
    ``sliding_window`` the query at position p sees keys j with p - sliding_window < j <= p.
    ``config``: the tile shape (``prefill_config``'s keys; those left out keep their
    defaults), for tuning. Writes into ``out`` (q's shape and dtype) when given; returns it.
    ``k``, ``v``: this step's keys and values, [num_tokens, num_kv_heads, head_dim], the
    rows that were just stored into the cache; given, the kernel reads the tiles of them
    from there (contiguous, in bulk) instead of through the block table. ``k_scale``,
    ``v_scale`` (float32, one element each): a float8 cache's scales."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_heads(q, k_cache)
    if num_tokens and max_seqlen_q < 1:
        # The grid has cdiv(max_seqlen_q, BLOCK_M) query tiles per sequence: with 0, nothing would run.
        raise ValueError(f"max_seqlen_q must bound every sequence's query length (>= 1), got {max_seqlen_q}")
    if not scale > 0:
        # The online softmax takes each row's max of the raw scores before scaling them.
        raise ValueError(f"scale must be > 0, got {scale}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    num_seqs = cu_seqlens_q.shape[0] - 1
    group = num_heads // num_kv_heads
    defaults = prefill_config(head_dim, group, q.is_cuda, max_seqlen_q, q.element_size())
    if config is not None and not set(config) <= set(defaults):
        raise ValueError(f"config keys must be among {sorted(defaults)}, got {sorted(config)}")
    config = {**defaults, **(config or {})}
    k_new = v_new = None
    if config["NEW_KV"]:
        k_new, v_new = step_kv_descriptor(k, k_cache, config["BLOCK_N"]), step_kv_descriptor(v, v_cache, config["BLOCK_N"])
        config["NEW_KV"] = k_new is not None and v_new is not None
    config["FROM_SCRATCH"] = config["FROM_SCRATCH"] and config["NEW_KV"]
    grid = (triton.cdiv(max_seqlen_q, config["BLOCK_M"]), num_seqs, num_kv_heads)
    k_scale, v_scale = kv_scales(k_cache, v_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_new, v_new, block_tables, context_lens, cu_seqlens_q, out, k_scale, v_scale, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), sliding_window or 0,
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PRECISION=dot_precision(q.dtype), **config,
    )
    return out



def short_prefill_rows(max_seqlen_q: int, group: int) -> int:
    """Rows of the short-prefill kernel's query tile: max_seqlen_q positions (a power of two)
    times the KV group's heads (likewise), at least the 16 that ``tl.dot`` takes."""
    return max(16, triton.next_power_of_2(max(1, max_seqlen_q)) * triton.next_power_of_2(group))


# The largest query tile the short-prefill kernel takes, in elements (rows x head_dim): the
# tile and its float32 accumulator stay in registers. At head_dim 128, 64 rows: a verifying
# step of up to 15 drafts at a group of 4, of 7 at a group of 8; at head_dim 256, half that.
# A wider step runs the prefill kernel.
SHORT_PREFILL_TILE = 64 * 128


def takes_short_prefill(max_seqlen_q: int, group: int, head_dim: int) -> bool:
    """Does a prefill step of queries of at most ``max_seqlen_q`` tokens fit the short-prefill
    kernel's tile (SHORT_QUERY tokens at most, SHORT_PREFILL_TILE elements)?"""
    return 1 <= max_seqlen_q <= SHORT_QUERY and short_prefill_rows(max_seqlen_q, group) * head_dim <= SHORT_PREFILL_TILE


def short_prefill_pays(num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> bool:
    """Is a short step's batch small enough that the short-prefill kernel beats the prefill
    kernel? The prefill kernel runs one program per (sequence, K/V head) here; while those
    fill at most a quarter of the multiprocessors, splitting each context pays for the merge.
    (From scripts/bench_verify_cost.py; history in benchmarks/attention_tuning.md.)"""
    return 4 * num_seqs * num_kv_heads <= num_sms


def paged_short_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    max_context_len: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A prefill step whose every sequence computes few tokens (at most ``max_seqlen_q``:
    a verifying step of speculative decoding, a short chunk) on the decode kernel's plan:
    one program per (sequence, K/V head, split of the cached context), all of a sequence's
    queries and its group's heads in one tile, the splits merged by log-sum-exp. The prefill
    kernel gives such a step one program per (sequence, K/V head), which walks the whole
    context alone: at batch 1, 8 programs on 132 multiprocessors.

    q: [num_tokens, num_heads, head_dim], packed (cu_seqlens_q); context_lens count each
    sequence's keys after the step. ``k``, ``v`` ([num_tokens, num_kv_heads, head_dim]) are
    the step's own keys and values, not yet in the cache: the kernel stores each at its slot
    (-1: nothing to store) and attends over them causally. ``max_context_len`` bounds the
    context lengths (it sizes the splits: under a CUDA graph, max_model_len). Rows of q that
    belong to no sequence (a graph's padding) get no defined value: the caller drops them.
    ``k_scale``, ``v_scale`` (float32, one element each): a float8 cache's scales."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    _check_heads(q, k_cache)
    rows = short_prefill_rows(max_seqlen_q, group)
    if num_tokens and not takes_short_prefill(max_seqlen_q, group, head_dim):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} at a group of {group} and head_dim {head_dim} needs a tile of "
                         f"{rows} x {head_dim}; this kernel takes 1 <= max_seqlen_q <= {SHORT_QUERY} and at most "
                         f"{SHORT_PREFILL_TILE} elements (use paged_prefill_attention)")
    if num_tokens and max_context_len < 1:
        raise ValueError(f"max_context_len must bound every sequence's context length (>= 1), got {max_context_len}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    _check_step_kv(k, v, slot_mapping, "num_tokens", (num_tokens, num_kv_heads, head_dim))
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_splits is None:
        sms = sm_count(q)
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context_len, sms)
    config = {**decode_config(head_dim, k_cache.element_size()), **(config or {})}
    block_g = triton.next_power_of_2(group)
    block_q = rows // block_g
    return _split_context_attention(
        (num_seqs, num_kv_heads, num_splits), q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
        k, v, slot_mapping, torch.empty_like(q), scale, sliding_window, config, k_scale, v_scale,
        BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_QK=max(16, block_q), NEW_KV=True, DECODE=False)
