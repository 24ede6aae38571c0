"""RMSNorm, with the residual add fused in.

A pre-norm decoder layer always does ``residual = x + residual; x = norm(residual)``.
Doing both in one call saves a pass over the activations (and, on the GPU, a kernel).
The math is the op ``minivllm.ops.norm.rms_norm``.
"""
import torch
from torch import nn

from minivllm.ops.norm import fused_add_rms_norm, gemma_rms_norm


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
        return fused_add_rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (also Qwen3.5's and Qwen3-Next's): x / rms(x) * (1 + weight), in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)
