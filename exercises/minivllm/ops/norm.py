# Exercise copy of minivllm/ops/norm.py, generated from it by scripts/make_exercises.py.
# Fill in: rms_norm (ch01), gemma_rms_norm (ch11).
# Grade: make grade CH=01; make grade CH=11
# Running the generator again overwrites this file: commit or copy your work first.

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
    raise NotImplementedError(
        "ch01: rms_norm: y = x / sqrt(mean(x**2) + eps) * weight, statistics in float32, result in "
        "x's dtype, see notebooks/01_weights_forward.ipynb"
    )


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
    raise NotImplementedError(
        "ch11: gemma_rms_norm: in float32, x32 / sqrt(mean(x32**2 over the last dim) + eps) * (1 + "
        "weight in float32), cast to x.dtype only at the end, see "
        "notebooks/11_model_families.ipynb"
    )
