# Reference copy of minivllm/layers/rotary.py, generated from it by scripts/make_exercises.py.
# Reference answers for: rope_inv_freq (ch03), llama3_scale_inv_freq (ch03), RotaryEmbedding.__init__ (ch03).
# Do not edit: change minivllm/layers/rotary.py and run scripts/make_exercises.py again.

"""Rotary position embeddings (RoPE).

Each pair of channels (i, i + d/2) of a query or key is rotated by the angle
``position * inv_freq[i]``. A dot product of a rotated query and key then depends only on
their distance. The angles are precomputed once as a cos/sin cache indexed by position;
the rotation itself is the op ``minivllm.ops.rotary``.
"""
import math

import torch
from torch import nn

from minivllm.layers.norm import RMSNorm
from minivllm.ops.rotary import qk_norm_rope


def rope_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """The rotation speed of each channel pair: base ** (-2i / rotary_dim), i = 0 .. rotary_dim/2 - 1."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def llama3_scale_inv_freq(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3's context extension: slow the low-frequency channels down by ``factor``,
    keep the high-frequency ones, and blend smoothly in between."""
    old_context = original_max_position_embeddings
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, rotary_dim: int | None = None, scaling: dict | None = None
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = rope_inv_freq(self.rotary_dim, base)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = llama3_scale_inv_freq(inv_freq, scaling["factor"], scaling["low_freq_factor"],
                                             scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3")
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # Not saved in the state dict: the cache is a function of the config.
        self.register_buffer("cos_cache", angles.cos(), persistent=False)
        self.register_buffer("sin_cache", angles.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys ([tokens, heads, head_dim]) to their positions ([tokens]).

        With ``q_norm`` and ``k_norm`` (norms over head_dim) each head is normalised first.
        RMSNorms (Qwen3's q/k norm) and the rotation are one fused kernel on a GPU; another
        norm (Gemma's, which scales by 1 + weight) runs on its own before the rotation.
        """
        if q_norm is not None and not isinstance(q_norm, RMSNorm):
            q, k, q_norm, k_norm = q_norm(q), k_norm(k), None, None
        weights = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        return qk_norm_rope(q, k, positions, self.cos_cache, self.sin_cache, *weights)
