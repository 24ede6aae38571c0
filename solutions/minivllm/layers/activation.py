# Reference copy of minivllm/layers/activation.py, generated from it by scripts/make_exercises.py.
# Reference answers for: silu_and_mul (ch01).
# Do not edit: change minivllm/layers/activation.py and run scripts/make_exercises.py again.

"""Gated activations for the feed-forward block."""
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.ops.dispatch import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: x holds [gate | up] side by side; return silu(gate) * up.

    The gate and up projections are packed into one matrix (one matmul instead of two),
    so their outputs arrive concatenated along the last dimension.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from minivllm.kernels.elementwise import silu_and_mul as silu_and_mul_kernel

            return silu_and_mul_kernel(x)
        return silu_and_mul(x)
