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
        "ch01: rms_norm: divide each row (the last dimension) by its root mean square, the square "
        "root of the mean of its squares plus eps, then scale by weight. The statistics are "
        "computed in float32 whatever x's dtype, and the normalised row goes back to x's dtype "
        "before weight multiplies it (as the reference model does). Pitfalls: eps goes inside the "
        "square root; in bfloat16 the mean of squares keeps too few digits, see "
        "notebooks/01_weights_forward.ipynb"
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
        "ch11: gemma_rms_norm: RMSNorm as Gemma defines it: the whole computation in float32, the "
        "weight included, and the weight stored as an offset from one, so the scale is one plus "
        "weight. Back to x's dtype only at the very end. Pitfall: Llama's order (back to x's dtype "
        "before the weight) gives different bfloat16 results, see "
        "notebooks/11_model_families.ipynb"
    )
