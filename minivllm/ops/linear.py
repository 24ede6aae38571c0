"""y = x W^T (+ b) as an op.

Decode at a small batch on the GPU is a matrix times a few vectors, bound by reading W:
there ``kernels.gemv`` beats a general GEMM, up to the rows it is built for
(``gemv.MAX_ROWS``). Everything else is torch's GEMM.
"""
import torch
import torch.nn.functional as F

from minivllm.ops.dispatch import use_triton


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x) and x.dim() == 2:
        from minivllm.kernels import gemv

        if x.shape[0] <= gemv.MAX_ROWS:
            return gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)
