"""Write a step's new keys and values into the paged KV cache, one program per token.

Roofline: reads and writes 2 * num_tokens * num_kv_heads * head_dim elements; no FLOPs.
Slot -1 marks a padding token (a CUDA-graph batch padded to a captured size): skipped.
A float8 cache (chapter 20) stores key / k_scale and value / v_scale, saturated at +-448:
half the bytes written, and half read by every later step. Its values are laid out
key-contiguous, [num_blocks, kv_heads, head_dim, block_size] in memory (seen through strides
as the usual [num_blocks, block_size, kv_heads, head_dim]): the attention's second product,
p . v, takes the values as a tensor-core operand with the keys contiguous. A bf16 tile is
transposed on its way from shared memory (ldmatrix.trans), but Hopper has no such transpose
for one-byte elements, and a float8 tile laid out like the keys is gathered byte by byte,
which costs more than the halved bytes save. Every value in a float8 pool is finite (the
pool starts zeroed and a NaN is stored as 0), so the attention may read a tile's rows past a
sequence's last key unmasked: their weight is exactly 0, and 0 x finite = 0.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import pdl_options, wait_for_previous

# e4m3's largest finite value (1.75 * 2^8).
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def load_kv_scale(scale_ptr, cache_ptr):
    """The scale a cache's elements are stored divided by: a float8 cache's (one float32,
    read from its layer's buffer, so a CUDA graph sees a new value), 1.0 for any other."""
    scale = 1.0
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        scale = tl.load(scale_ptr).to(tl.float32)
    return scale


@triton.jit
def attention_input(q, cache_ptr):
    """q in the dtype an attention kernel takes q, K and V tiles in. For a float8 cache:
    float16. e4m3 becomes float16 in one packed instruction per two elements
    (cvt.rn.f16x2.e4m3x2), where bfloat16 takes that and two more on sm_90: fewer
    instructions per element in a kernel that reads a great many. float16 holds every e4m3
    value exactly, and q's values with three more
    mantissa bits than bfloat16 (within its +-65,504: normalised queries are far inside).
    float32 queries (a parity run's) and any other cache: q as it is."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype != tl.float32:
        q = q.to(tl.float16)
    return q


@triton.jit
def quantize_kv(x, scale, cache_ptr):
    """Keys or values x as the cache at cache_ptr holds them: for a float8 cache x / scale in
    float32, clamped to [-448, 448] so that a large value saturates instead of becoming NaN
    (e4m3 has no inf), then rounded to e4m3; for any other, x in the cache's dtype. The
    division is a multiply by 1 / scale, rounded as IEEE (and torch) round it: one multiply
    per element, where a division is several instructions, and the same bits as the torch
    reference's store."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = x.to(tl.float32) * tl.math.div_rn(1.0, scale)
        x = tl.where(x == x, x, 0.0)  # NaN: 0, so that the pool holds only finite values
        x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def value_offsets(slot, kv_head, d, stride_cb, stride_cs, stride_ch, cache_ptr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64) of the values of cache slot(s) ``slot`` (flat: block * block_size
    + row), K/V head(s) ``kv_head``, dimension(s) ``d`` (broadcast together): for a float8
    cache in its key-contiguous layout, for any other as the keys (the strides' layout)."""
    block = (slot // BLOCK_SIZE).to(tl.int64) * stride_cb
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return block + kv_head * (HEAD_DIM * BLOCK_SIZE) + d * BLOCK_SIZE + slot % BLOCK_SIZE
    return block + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch + d


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], each token's heads one contiguous row
    v_ptr,  # [num_tokens, num_kv_heads, head_dim], likewise
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous: row s is slot s
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], likewise
    slot_ptr,  # [num_tokens]: each token's flat slot, -1 for padding
    k_scale_ptr, v_scale_ptr,  # [1] float32: a float8 cache's scales (not read otherwise)
    stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return  # a padding token: nothing to store
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    k = quantize_kv(k, load_kv_scale(k_scale_ptr, k_cache_ptr), k_cache_ptr)
    v = quantize_kv(v, load_kv_scale(v_scale_ptr, v_cache_ptr), v_cache_ptr)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    v_offs = value_offsets(slot, offs // HEAD_DIM, offs % HEAD_DIM, BLOCK_SIZE * ROW, ROW, HEAD_DIM, v_cache_ptr,
                           HEAD_DIM, BLOCK_SIZE)
    tl.store(v_cache_ptr + v_offs, v, mask=mask)


def kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors a kernel is given: a float8 cache needs both (and its values in
    their layout: checked); any other cache never reads them, and the cache itself stands
    in for a pointer."""
    if k_cache.dtype == torch.float8_e4m3fn:
        check_kv_caches(k_cache, v_cache)
        if k_scale is None or v_scale is None:
            raise ValueError("a float8 KV cache needs k_scale and v_scale (float32 tensors of one element)")
        return k_scale, v_scale
    return k_cache, k_cache


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches [num_blocks, block_size, kv_heads, head_dim], the keys contiguous, a
    float8 cache's values in their key-contiguous layout (``ops.attention.value_cache_view``),
    any other cache's as the keys."""
    if not k_cache.is_contiguous() or k_cache.dim() != 4:
        raise ValueError(f"k_cache must be a contiguous [num_blocks, block_size, kv_heads, head_dim] tensor, "
                         f"got shape {tuple(k_cache.shape)}, strides {k_cache.stride()}")
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    want = k_cache.stride()
    if k_cache.dtype == torch.float8_e4m3fn:
        want = (block_size * kv_heads * head_dim, 1, head_dim * block_size, block_size)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.stride() != want:
        raise ValueError(f"v_cache must be k_cache's shape and dtype with strides {want} "
                         f"(ops.attention.value_cache_view), got {tuple(v_cache.shape)}, {v_cache.dtype}, "
                         f"{v_cache.stride()}")


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    tokens, heads, head_dim = k.shape
    row = heads * head_dim
    for name, x in (("k", k), ("v", v)):
        # Each token's heads must be one contiguous row (a view into the packed qkv output is fine).
        if x.stride(-1) != 1 or x.stride(-2) != head_dim:
            raise ValueError(f"{name} must have contiguous heads, got strides {x.stride()}")
    if k_cache.shape[-2:] != (heads, head_dim):
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not hold [.., {heads}, {head_dim}] rows")
    check_kv_caches(k_cache, v_cache)
    k_scale, v_scale = kv_scales(k_cache, v_cache, k_scale, v_scale)
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k.stride(0), v.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row), HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], **pdl_options(k),
    )
