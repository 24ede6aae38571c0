"""y = x W^T (+ b) as an op.

Decode at a small batch on the GPU is a matrix times a few vectors, bound by reading W:
there ``kernels.gemv`` beats a general GEMM, up to the rows it is built for
(``gemv.MAX_ROWS``). Everything else is torch's GEMM.

``act_linear`` is a gated MLP's down projection, act(gate) * up then the product: on the
matrix-vector path the kernel computes SwiGLU's activation as it loads its input (one launch
and one round trip through memory fewer a layer); elsewhere the two ops run one after the
other.
"""
import torch
import torch.nn.functional as F

from minivllm.ops.activation import act_and_mul
from minivllm.ops.dispatch import use_triton


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x) and x.dim() == 2:
        from minivllm.kernels import gemv

        if x.shape[0] <= gemv.MAX_ROWS:
            return gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def act_linear(x: torch.Tensor, activation: str, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(act(gate) * up, weight, bias) for x = [gate | up]."""
    if activation == "silu" and use_triton(x) and x.dim() == 2:
        from minivllm.kernels import gemv

        if x.shape[0] <= gemv.MAX_ROWS:
            return gemv.gemv(x, weight, bias, gated=True)
    return linear(act_and_mul(x, activation), weight, bias)
