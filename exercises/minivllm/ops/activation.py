# Exercise copy of minivllm/ops/activation.py, generated from it by scripts/make_exercises.py.
# Fill in: silu_and_mul (ch01).
# Grade: make grade CH=01
# Running the generator again overwrites this file: commit or copy your work first.

"""Gated activations as an op: x holds [gate | up] side by side, the result is act(gate) * up.

SwiGLU (``silu``) has a Triton kernel for the GPU; GeGLU (``gelu_tanh``, Gemma) runs the
torch reference everywhere.
"""
import torch
import torch.nn.functional as F

from minivllm.ops.dispatch import use_triton

ACTIVATIONS = ("silu", "gelu_tanh")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: x holds [gate | up] side by side; return silu(gate) * up.

    The gate and up projections are packed into one matrix (one matmul instead of two),
    so their outputs arrive concatenated along the last dimension.
    """
    raise NotImplementedError(
        "ch01: silu_and_mul: the MLP's gate and up projections arrive side by side in one tensor, "
        "the gate in the first half of the last dimension and the up projection in the second. The "
        "result is half as wide: the SiLU of the gate (z times sigmoid(z)) scales the up "
        "projection element by element. Pitfall: halves taken along another dimension may still "
        "have matching shapes, see notebooks/01_weights_forward.ipynb"
    )


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's gate: x holds [gate | up]; return gelu_tanh(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for x = [gate | up]: the Triton kernel for SwiGLU on a GPU, the
    torch reference elsewhere."""
    if activation == "silu":
        if use_triton(x):
            from minivllm.kernels.elementwise import silu_and_mul as silu_and_mul_kernel

            return silu_and_mul_kernel(x)
        return silu_and_mul(x)
    if activation == "gelu_tanh":
        return gelu_tanh_and_mul(x)
    raise ValueError(f"activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
