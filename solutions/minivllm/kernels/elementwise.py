# Reference copy of minivllm/kernels/elementwise.py, generated from it by scripts/make_exercises.py.
# Reference answers for: _rms_norm_kernel (ch09).
# Do not edit: change minivllm/kernels/elementwise.py and run scripts/make_exercises.py again.

"""Row-wise kernels of the decoder layer: fused residual-add + RMSNorm, SiLU-and-mul, RoPE.

Each is memory-bound: it reads its inputs once and writes its outputs once, doing a few
FLOPs per element, so the roofline is bytes / HBM bandwidth. Fusing (residual add into the
norm; gate into up) is the whole point: each fusion removes a full pass over the activations.

  rms_norm:     reads x (+ residual) and weight, writes y (+ new residual)   ~5 FLOP/elem
  silu_and_mul: reads [T, 2I], writes [T, I]                                 ~6 FLOP/elem
  qk_norm_rope: reads q, k (+ norm weights) and cos/sin rows, writes them     ~8 FLOP/elem
                normalised and rotated
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.pdl import pdl_options, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, n_cols]
    res_ptr,  # [rows, n_cols] (read only with HAS_RESIDUAL)
    w_ptr,  # [n_cols]
    out_ptr,  # [rows, n_cols]
    res_out_ptr,  # [rows, n_cols]: x + residual (written only with HAS_RESIDUAL)
    stride_x, stride_res, stride_out, stride_res_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # (a weight: no earlier kernel wrote it)
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add happens in the activations' dtype, as in the reference.
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / n_cols
    y = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
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
            HAS_RESIDUAL=False, BLOCK=block, **pdl_options(x),
        )
        return out.view(shape)
    res2 = residual.reshape(-1, n).contiguous()
    res_out = torch.empty_like(res2)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), n, eps,
        HAS_RESIDUAL=True, BLOCK=block, **pdl_options(x),
    )
    return out.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [rows, 2 * n_cols]: [gate | up]
    out_ptr,  # [rows, n_cols]
    stride_x, stride_out, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
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
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block,
                                                                    **pdl_options(x))
    return out.view(*x.shape[:-1], n)


@triton.jit
def _norm_rope_heads(
    x_ptr,  # [n_heads, 2 * HALF]: one token's heads of q or k
    out_ptr,  # [n_heads, 2 * HALF]
    w_ptr,  # [2 * HALF]: the norm's weight (read only with HAS_NORM)
    cos, sin, stride_xh, stride_oh, n_heads, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """One token's heads of q (or k): optional per-head RMSNorm, then the NeoX rotation."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < n_heads
    x1 = tl.load(x_ptr + h * stride_xh + d, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + h * stride_xh + HALF + d, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        # As the reference: statistics in float32, normalised value rounded to the
        # activations' dtype, then scaled by the weight in that dtype.
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + d)
        w2 = tl.load(w_ptr + HALF + d)
        x1 = (w1 * (x1 * rstd).to(dtype)).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype)).to(tl.float32)
    dst = out_ptr.dtype.element_ty
    tl.store(out_ptr + h * stride_oh + d, (x1 * cos - x2 * sin).to(dst), mask=mask)
    tl.store(out_ptr + h * stride_oh + HALF + d, (x2 * cos + x1 * sin).to(dst), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [tokens, n_q_heads, head_dim], head_dim contiguous (a view into qkv)
    k_ptr,  # [tokens, n_k_heads, head_dim], likewise
    q_out_ptr,  # [tokens, n_q_heads, head_dim]
    k_out_ptr,  # [tokens, n_k_heads, head_dim]
    q_w_ptr,  # [head_dim]: q norm weight (read only with HAS_NORM)
    k_w_ptr,  # [head_dim]: k norm weight (read only with HAS_NORM)
    pos_ptr,  # [tokens]
    cos_ptr,  # [max_position, head_dim / 2]
    sin_ptr,  # [max_position, head_dim / 2]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    n_q_heads, n_k_heads, eps,
    HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)
    # One cos/sin row serves every head of this token, queries and keys alike. The positions
    # were copied in before the step's first kernel and the cache is a constant: both are
    # read before waiting for the kernel before (the qkv projection), which wrote q and k.
    cos = tl.load(cos_ptr + pos * stride_cache + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cache + d)[None, :]
    wait_for_previous(USE_PDL)
    _norm_rope_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, q_w_ptr, cos, sin,
                     stride_qh, stride_qoh, n_q_heads, eps, HALF, BLOCK_QH, HAS_NORM)
    _norm_rope_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, k_w_ptr, cos, sin,
                     stride_kh, stride_koh, n_k_heads, eps, HALF, BLOCK_KH, HAS_NORM)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ([tokens, heads, head_dim], NeoX halves layout, full rotary) to
    ``positions``, after a per-head RMSNorm when the weights are given (Qwen3's q/k norm).

    One launch for both: q and k may be strided views into the packed qkv output, read in
    place. Unfused this is six kernels per layer (two copies to make the views contiguous,
    two norms, two rotations); at batch 1 launches, not bytes, are what cost.
    """
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    half = head_dim // 2
    if cos_cache.shape[-1] != half or head_dim & (head_dim - 1):
        raise ValueError(f"qk_norm_rope needs full rotary over a power-of-two head_dim, got {head_dim}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight, or neither")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need contiguous head_dim")
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, k_heads, head_dim, dtype=k.dtype, device=k.device)
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(tokens,)](
        q, k, q_out, k_out, q_weight if has_norm else q, k_weight if has_norm else k, positions,
        cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_cache.stride(0),
        q_heads, k_heads, eps,
        HALF=half, BLOCK_QH=triton.next_power_of_2(q_heads), BLOCK_KH=triton.next_power_of_2(k_heads),
        HAS_NORM=has_norm, **pdl_options(q),
    )
    return q_out, k_out
