# Exercise copy of minivllm/kernels/elementwise.py, generated from it by scripts/make_exercises.py.
# Fill in: _rms_norm_kernel (ch09).
# Grade: pytest exercises -k ch09
# Running the generator again overwrites this file: commit or copy your work first.

"""Row-wise kernels of the decoder layer: fused residual-add + RMSNorm, SiLU-and-mul, RoPE.

Each is memory-bound: it reads its inputs once and writes its outputs once, doing a few
FLOPs per element, so the roofline is bytes / HBM bandwidth. Fusing (residual add into the
norm; gate into up) is the whole point: each fusion removes a full pass over the activations.

  rms_norm:     reads x (+ residual) and weight, writes y (+ new residual)   ~5 FLOP/elem
  silu_and_mul: reads [T, 2I], writes [T, I]                                 ~6 FLOP/elem
  rope:         reads q, k and cos/sin rows, writes rotated q, k              ~3 FLOP/elem
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add happens in the activations' dtype, as in the reference.
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    raise NotImplementedError("ch09: RMSNorm in the kernel: variance = the sum of x32 * x32 over the row (tl.sum, axis 0) divided by n_cols (not BLOCK: the masked lanes are zeros, not columns); y = x32 * tl.rsqrt(variance + eps), cast back to x.dtype, see notebooks/09_triton_kernels.ipynb")
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, w * y, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual``, returns (norm(x + residual), x + residual)."""
    shape = x.shape
    n = shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    if residual is None:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0, n, eps,
            HAS_RESIDUAL=False, BLOCK=block,
        )
        return out.view(shape)
    res2 = residual.reshape(-1, n).contiguous()
    res_out = torch.empty_like(res2)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), n, eps,
        HAS_RESIDUAL=True, BLOCK=block,
    )
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim; returns silu(gate) * up."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} must be even: [gate | up]")
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*x.shape[:-1], n)


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cache,
    n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cache + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cache + d)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = h < n_heads
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + t * stride_ot + h * stride_oh
    dtype = out_ptr.dtype.element_ty
    tl.store(out + d[None, :], (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out + HALF + d[None, :], (x2 * cos + x1 * sin).to(dtype), mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate x ([tokens, heads, head_dim], NeoX halves layout) to ``positions``; full rotary only."""
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if cos_cache.shape[-1] != half or head_dim & (head_dim - 1):
        raise ValueError(f"rope kernel needs full rotary over a power-of-two head_dim, got {head_dim}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    _rope_kernel[(tokens,)](
        x, out, positions, cos_cache, sin_cache,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_cache.stride(0),
        heads, HALF=half, BLOCK_H=triton.next_power_of_2(heads),
    )
    return out
