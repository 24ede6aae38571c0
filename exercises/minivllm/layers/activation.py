# Exercise copy of minivllm/layers/activation.py, generated from it by scripts/make_exercises.py.
# Fill in: silu_and_mul (ch01).
# Grade: pytest exercises -k ch01
# Running the generator again overwrites this file: commit or copy your work first.

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
    raise NotImplementedError("ch01: silu_and_mul: split x in half along the last dim into gate and up, return silu(gate) * up, see notebooks/01_weights_forward.ipynb")


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from minivllm.kernels.elementwise import silu_and_mul as silu_and_mul_kernel

            return silu_and_mul_kernel(x)
        return silu_and_mul(x)
