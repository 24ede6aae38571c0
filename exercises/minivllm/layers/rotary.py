# Exercise copy of minivllm/layers/rotary.py, generated from it by scripts/make_exercises.py.
# Fill in: rope_inv_freq (ch03), llama3_scale_inv_freq (ch03), RotaryEmbedding.__init__ (ch03).
# Grade: make grade CH=03
# Running the generator again overwrites this file: commit or copy your work first.

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
    raise NotImplementedError(
        "ch03: rope_inv_freq: one inverse frequency per pair of rotated dimensions, rotary_dim / 2 "
        "of them: pair i turns at base to the power -2i / rotary_dim, so the first pair turns "
        "fastest (once per position) and the last slowest. Compute in float32. Pitfall: an "
        "exponent computed in integer arithmetic rounds to zero, see notebooks/03_rope.ipynb"
    )


def llama3_scale_inv_freq(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3's context extension: slow the low-frequency channels down by ``factor``,
    keep the high-frequency ones, and blend smoothly in between."""
    raise NotImplementedError(
        "ch03: Llama 3's scaling, by wavelength (2 pi over a channel's inverse frequency) against "
        "the original context: a channel whose wavelength is longer than the original context "
        "divided by low_freq_factor turns too slowly to have seen whole turns in training: divide "
        "its frequency by factor. One shorter than the context divided by high_freq_factor keeps "
        "its frequency. In between, blend linearly between the two, with a weight smooth that is "
        "the original context over the wavelength, minus low_freq_factor, over the difference of "
        "the two factors: (1 - smooth) times the slowed frequency plus smooth times the original. "
        "Both boundaries belong to the blend. Pitfall: comparing frequencies where the rule speaks "
        "of wavelengths reverses every inequality, see notebooks/03_rope.ipynb"
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, rotary_dim: int | None = None, scaling: dict | None = None
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        raise NotImplementedError(
            "ch03: the cos/sin cache: the inverse frequencies of rotary_dim, rescaled by the "
            "config's rope scaling: llama3 (its four parameters, from the scaling dict), linear "
            "(divide every frequency by factor), default (none); any other type is a ValueError "
            "naming it. The rope type is under the key rope_type, or type in older configs. The "
            "angle of position t and pair i is t times inv_freq[i], for every position up to "
            "max_position, in float32; register their cosines and sines as the buffers cos_cache "
            "and sin_cache, not persistent (they come from the config, not the checkpoint). "
            "Pitfall: the outer product's order decides which axis is the position, see "
            "notebooks/03_rope.ipynb"
        )

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
