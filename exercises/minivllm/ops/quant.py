# Exercise copy of minivllm/ops/quant.py, generated from it by scripts/make_exercises.py.
# Fill in: quantize_per_row (ch20).
# Grade: make grade CH=20
# Running the generator again overwrites this file: commit or copy your work first.

"""FP8 (e4m3) quantization: scales, saturation, and the W8A8 matmul with its torch reference.

An e4m3 number has 4 exponent bits and 3 mantissa bits: 448 is its largest finite value and
it keeps about two significant decimal digits. A tensor is stored as q = x / s rounded to
e4m3, with a float32 scale s chosen so that the largest |x| it covers lands on 448
(``amax / 448``); q * s is then x to within e4m3's relative rounding (2^-4). Where the scale
lives is the whole design:

- per output channel (a row of W, [N, 1]): the weights of one output are in one range;
- per token (a row of x, [M, 1]), computed at each call ("dynamic"): activations change
  with every input, and one outlier token spoils only its own row;
- per 128x128 block of W and per 1x128 group of a token (the hub's FP8 checkpoints): a
  finer grid, which the block-scaled kernel (``kernels.fp8_matmul``) applies tile by tile.

Values past the scale's range saturate at +-448: e4m3 has no inf, and a cast of a larger
value may give NaN, so the clamp comes before the cast.
"""
import functools

import torch

from minivllm.ops.dispatch import use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# The smallest scale: an all-zero row gets this instead of 0, so q = x / s stays finite.
MIN_SCALE = 1e-12


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (e4m3 [rows, K], float32 scale [rows, 1]): one scale per row (an
    output channel of a weight, or a token of the activations), amax / 448."""
    raise NotImplementedError(
        "ch20: quantize_per_row: each row (an output channel of a weight, or one token's "
        "activations) gets its own float32 scale, chosen so that the row's largest magnitude lands "
        "exactly on e4m3's largest finite value, FP8_MAX; the row is stored as itself over its "
        "scale, rounded to e4m3. Do the arithmetic in float32 whatever x's dtype. Two pitfalls: a "
        "row of zeros has a largest magnitude of 0, and a scale of 0 turns every value into 0 / 0 "
        "(MIN_SCALE is the floor a scale may not go under); and what a cast to e4m3 makes of a "
        "value past its range is the implementation's choice (the largest value, or NaN), so "
        "whatever rounding could push past the range is saturated before the cast. The scale keeps "
        "a column axis of length one, so that it broadcasts against the row, see "
        "notebooks/20_quantization.ipynb"
    )


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, ceil(K / group)]): one scale for each
    ``group`` consecutive values of a row (the activations of the block-scaled matmul)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, groups]
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k], scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale [ceil(N / bn), ceil(K / bk)]): one scale per
    bn x bk block, as the hub's FP8 checkpoints store ``weight_scale_inv``."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(rows, bn, cols, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def dequantize_per_row(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [rows, K] and scale [rows, 1] -> float32 [rows, K]."""
    return q.float() * scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 [N, K] and block scales [ceil(N / bn), ceil(K / bk)] -> float32 [N, K]: each
    block scale repeated over its bn x bk values (cut at the matrix's edge)."""
    bn, bk = block
    n, k = q.shape
    return q.float() * scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def quantize_activations(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations of a W8A8 product, quantized at each call: one scale per token
    (``group`` None: [M, 1]) or per token per ``group`` columns ([M, ceil(K / group)]). One
    Triton kernel on a GPU; the torch spec elsewhere."""
    if not use_triton(x):
        return quantize_per_row(x) if group is None else quantize_per_group(x, group)
    from minivllm.kernels.fp8_matmul import quantize_groups

    return quantize_groups(x, x.shape[1] if group is None else group, FP8_MAX, MIN_SCALE)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b), W8A8 per channel: x quantized per token, both dequantized and
    multiplied in float32. The CPU path and the oracle of the GPU's."""
    x_q, x_scale = quantize_per_row(x)
    y = dequantize_per_row(x_q, x_scale) @ dequantize_per_row(weight, weight_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can ``torch._scaled_mm`` take this product? It runs on the FP8 tensor cores of a CUDA
    GPU (compute capability 8.9 or more), with K and N multiples of 16, and row-wise scales
    with a bfloat16 output."""
    n, k = weight.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0
            and _has_fp8_tensor_cores(x.device.index or 0))


@functools.cache
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 with per-channel weight scales: x [M, K] in the model's dtype, weight e4m3 [N, K],
    weight_scale float32 [N, 1]. On the FP8 tensor cores when ``scaled_mm_fits``; a shape
    (or a GPU) they do not take runs the float32 reference, correct but slow."""
    if not scaled_mm_fits(x, weight):
        return fp8_linear_reference(x, weight, weight_scale, bias)
    x_q, x_scale = quantize_activations(x)
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(),
                            bias=bias, out_dtype=x.dtype)


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                               block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for block-scaled weights: x quantized per 1 x bk group of each token,
    both dequantized and multiplied in float32 (the CPU path, the Triton kernel's oracle)."""
    x_q, x_scale = quantize_per_group(x, block[1])
    x_deq = dequantize_blocks(x_q, x_scale, (1, block[1]))
    y = x_deq @ dequantize_blocks(weight, weight_scale_inv, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 with block-scaled weights: x [M, K] quantized per token per bk columns, then the
    block-scaled matmul (``kernels.fp8_matmul`` on a GPU, the float32 reference elsewhere)."""
    if not use_triton(x):
        return fp8_block_linear_reference(x, weight, weight_scale_inv, block, bias)
    from minivllm.kernels.fp8_matmul import block_fp8_matmul

    x_q, x_scale = quantize_activations(x, block[1])
    return block_fp8_matmul(x_q, x_scale, weight, weight_scale_inv, block, bias, out_dtype=x.dtype)
