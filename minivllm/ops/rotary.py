"""Rotary position embeddings as an op: rotate queries and keys to their positions, after
an optional per-head RMSNorm (Qwen3's q/k norm).

On a GPU one Triton kernel does both for q and k (``kernels.elementwise.qk_norm_rope``)
when every channel rotates and head_dim is a power of two; otherwise the norm op and the
torch rotation run one after the other.
"""
import torch

from minivllm.ops.dispatch import use_triton
from minivllm.ops.norm import fused_add_rms_norm


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x ([tokens, heads, rotary_dim]) by the angles whose cos and sin are given
    ([tokens, rotary_dim / 2]). Channel i pairs with channel i + rotary_dim/2 (the "NeoX"
    layout that Llama, Qwen and Gemma checkpoints use)."""
    # BEGIN SOLUTION ch03 apply_rotary
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    # END SOLUTION


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary over the first rotary_dim = 2 * cos.shape[-1] channels of x; with partial
    rotary the other channels carry no position and pass through."""
    # BEGIN SOLUTION ch03 partial_rotary
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    # END SOLUTION


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k ([tokens, heads, head_dim]) rotated to ``positions`` ([tokens]) with the
    angles of the cos/sin caches ([max_position, rotary_dim / 2]), after a per-head RMSNorm
    when the norm weights are given."""
    head_dim = q.shape[-1]
    # The kernel's own condition: full rotary over a power-of-two head_dim.
    if use_triton(q) and 2 * cos_cache.shape[-1] == head_dim and not head_dim & (head_dim - 1):
        from minivllm.kernels.elementwise import qk_norm_rope as qk_norm_rope_kernel

        # One launch for q and k, read in place in the packed qkv output.
        weights = () if q_weight is None else (q_weight, k_weight)
        return qk_norm_rope_kernel(q, k, positions, cos_cache, sin_cache, *weights, eps=eps)
    if q_weight is not None:
        q, k = fused_add_rms_norm(q, q_weight, eps), fused_add_rms_norm(k, k_weight, eps)
    cos = cos_cache[positions].to(q.dtype)
    sin = sin_cache[positions].to(q.dtype)
    return rotate(q, cos, sin), rotate(k, cos, sin)
