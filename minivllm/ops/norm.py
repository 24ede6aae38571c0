"""RMSNorm as an op: the torch reference (chapter 01) and, on a GPU, the fused Triton kernel
(chapter 09) that also does the residual add; and Gemma's variant (chapter 11), which
scales by 1 + weight and has no kernel."""
import torch

from minivllm.ops.dispatch import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dimension of x by its root mean square, then scale by weight.

    The statistics are computed in float32 whatever x's dtype, as transformers does:
    a bfloat16 mean of squares over thousands of channels loses too many bits.
    """
    # BEGIN SOLUTION ch01 rms_norm
    dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(dtype)
    # END SOLUTION


def fused_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without ``residual``: rms_norm(x). With it: add x into the residual stream first and
    return (rms_norm(x + residual), x + residual). One kernel for both on a GPU."""
    if use_triton(x):
        from minivllm.kernels.elementwise import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps, residual)
    if residual is None:
        return rms_norm(x, weight, eps)
    x = x + residual
    return rms_norm(x, weight, eps), x


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + weight), all in float32, cast back to x's dtype at the end."""
    # BEGIN SOLUTION ch11 gemma_rms_norm
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)
    # END SOLUTION
