"""Write a step's new keys and values into the paged KV cache, one program per token.

Roofline: reads and writes 2 * num_tokens * num_kv_heads * head_dim elements; no FLOPs.
Slot -1 marks a padding token (a CUDA-graph batch padded to a captured size): skipped.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import pdl_options, wait_for_previous


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], each token's heads one contiguous row
    v_ptr,  # [num_tokens, num_kv_heads, head_dim], likewise
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous: row s is slot s
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], likewise
    slot_ptr,  # [num_tokens]: each token's flat slot, -1 for padding
    stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
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
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    tokens, heads, head_dim = k.shape
    row = heads * head_dim
    for name, x in (("k", k), ("v", v)):
        # Each token's heads must be one contiguous row (a view into the packed qkv output is fine).
        if x.stride(-1) != 1 or x.stride(-2) != head_dim:
            raise ValueError(f"{name} must have contiguous heads, got strides {x.stride()}")
    if k_cache.shape[-2:] != (heads, head_dim) or not k_cache.is_contiguous():
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not hold [.., {heads}, {head_dim}] rows")
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row), **pdl_options(k),
    )
