# Exercise copy of minivllm/ops/rotary.py, generated from it by scripts/make_exercises.py.
# Fill in: apply_rotary (ch03), rotate (ch03).
# Grade: make grade CH=03
# Running the generator again overwrites this file: commit or copy your work first.

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
    raise NotImplementedError(
        "ch03: apply_rotary: turn every pair of features by its position's angle. In this layout "
        "(Llama's and Qwen's in transformers) feature i pairs with feature i + d/2, not with i + "
        "1: the first and second halves of the last dimension are the two coordinates of d/2 "
        "points in the plane, each rotated by its own angle with the usual 2-D rotation. cos and "
        "sin hold one row per token and d/2 columns, and x has a heads dimension in between: they "
        "must broadcast over the heads. Pitfall: pairing neighbouring features is a valid rotation "
        "too, with other numbers, see notebooks/03_rope.ipynb"
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary over the first rotary_dim = 2 * cos.shape[-1] channels of x; with partial
    rotary the other channels carry no position and pass through."""
    raise NotImplementedError(
        "ch03: rotate: partial rotary. cos holds one column per rotated pair, so twice its width "
        "is rotary_dim, the channels that turn; when that is all of x's last dimension, rotate it "
        "all; otherwise rotate the first rotary_dim channels and pass the rest through unchanged, "
        "after them. Pitfall: the pairs are formed inside the rotated part (i with i + rotary_dim "
        "/ 2), not across the whole head, see notebooks/03_rope.ipynb"
    )


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
