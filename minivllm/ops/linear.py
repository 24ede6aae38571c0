"""y = x W^T (+ b) as an op, and the feed-forward's gated projection act(x W_gate^T) * x W_up^T.

Decode at a small batch on the GPU is a matrix times a few vectors, bound by reading W:
there ``kernels.gemv`` beats a general GEMM, up to the rows it is built for
(``gemv.MAX_ROWS``), and for SwiGLU it ends the gate/up product in the activation, one
kernel instead of two. Everything else is torch's GEMM and the activation op.

W may be e4m3 with one scale per row (``weight_scale``, chapter 20): the gemv reads the
bytes and keeps the activations as they are (W8A16); more rows take the W8A8 matmul of
``ops.quant``.
"""
import torch
import torch.nn.functional as F

from minivllm.ops.activation import act_and_mul
from minivllm.ops.dispatch import use_triton
from minivllm.ops.quant import fp8_linear


def _gemv_serves(x: torch.Tensor) -> bool:
    if not (use_triton(x) and x.dim() == 2):
        return False
    from minivllm.kernels import gemv

    return x.shape[0] <= gemv.MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b); with ``weight_scale`` [N, 1], W is e4m3 and each row is times its scale."""
    if _gemv_serves(x):
        from minivllm.kernels import gemv

        return gemv.gemv(x, weight, bias, weight_scale=weight_scale)
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias)
    return F.linear(x, weight, bias)


def gated_linear_fuses(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> bool:
    """Does gated_linear run as one kernel here (SwiGLU, no bias, a few rows on a GPU)?"""
    return activation == "silu" and bias is None and _gemv_serves(x)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str = "silu", weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up where [gate | up] = x W^T (+ b), W holding the gate's rows then up's
    (e4m3 with ``weight_scale``, as ``linear``)."""
    if gated_linear_fuses(x, bias, activation):
        from minivllm.kernels import gemv

        return gemv.gemv_silu_and_mul(x, weight, weight_scale=weight_scale)
    return act_and_mul(linear(x, weight, bias, weight_scale), activation)
