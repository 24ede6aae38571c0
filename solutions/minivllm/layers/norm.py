# Reference copy of minivllm/layers/norm.py, generated from it by scripts/make_exercises.py.
# Reference answers for: rms_norm (ch01).
# Do not edit: change minivllm/layers/norm.py and run scripts/make_exercises.py again.

"""RMSNorm, with the residual add fused in.

A pre-norm decoder layer always does ``residual = x + residual; x = norm(residual)``.
Doing both in one call saves a pass over the activations (and, on the GPU, a kernel).
"""
import torch
from torch import nn

from minivllm.ops.dispatch import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dimension of x by its root mean square, then scale by weight.

    The statistics are computed in float32 whatever x's dtype, as transformers does:
    a bfloat16 mean of squares over thousands of channels loses too many bits.
    """
    dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: return norm(x). With it: add x into the residual
        stream first and return (norm(x + residual), x + residual)."""
        if use_triton(x):
            from minivllm.kernels.elementwise import rms_norm as rms_norm_kernel

            return rms_norm_kernel(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x
