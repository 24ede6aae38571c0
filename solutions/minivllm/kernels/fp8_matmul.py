# Reference copy of minivllm/kernels/fp8_matmul.py, generated from it by scripts/make_exercises.py.
# Reference answers for: _block_fp8_matmul_kernel (ch20).
# Do not edit: change minivllm/kernels/fp8_matmul.py and run scripts/make_exercises.py again.

"""y = (a_q * a_s) @ (w_q * w_s)^T: the W8A8 matmul of block-scaled FP8 checkpoints.

The hub's FP8 checkpoints store each linear weight as e4m3 [N, K] with one float32 scale
per 128 x 128 block (``weight_scale_inv``, [ceil(N / 128), ceil(K / 128)]); the activations
are quantized at each call with one scale per token per 128 columns (a 1 x 128 group). Within
one K step of 128 columns every product a[m, k] * w[n, k] then shares two scales, a_s[m, kb]
and w_s[n // 128, kb]: the tile's fp8 dot product runs on the tensor cores as it is, and the
scales multiply its float32 result once per K step, not once per product:

    acc[m, n] += (a_q[m, kb-th 128 columns] . w_q[n, same columns]) * a_s[m, kb] * w_s[n // 128, kb]

Per product: bytes ~ (M + N) * K at one byte each (+ the scales, 4 / 128 of that) + 2 M N
out; FLOPs = 2 M N K on the FP8 tensor cores, twice bf16's rate. The activations are
quantized before it by ``quantize_groups`` (one scale per token per group of columns; per
token, for the per-channel W8A8 product, with the group the whole row). The torch reference
of the whole product is ``ops.quant.fp8_block_linear_reference``, its op
``ops.quant.fp8_block_linear``.
"""
import torch
import triton
import triton.language as tl



@triton.jit(do_not_specialize=["K", "GROUP"])
def _quantize_groups_kernel(
    x_ptr,  # [M, K] in the model's dtype
    q_ptr,  # [M, K] e4m3
    s_ptr,  # [M, ceil(K / GROUP)] float32
    K, GROUP, stride_xm, stride_qm, stride_sm,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per (row, group of GROUP columns): the group's amax in a first pass, then
    x / scale saturated to +-FP8_MAX and stored as e4m3 in a second."""
    row, group = tl.program_id(0), tl.program_id(1)
    start = group * GROUP
    end = tl.minimum(start + GROUP, K)
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(start, end, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < end, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax) / FP8_MAX, MIN_SCALE)
    for k0 in range(start, end, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + k, mask=k < end, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < end)
    tl.store(s_ptr + row * stride_sm + group, scale)


def quantize_groups(x: torch.Tensor, group: int, fp8_max: float, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, ceil(K / group)]): one read of x, one write
    of a byte per value (the torch spec, ``ops.quant.quantize_per_group``, takes several
    passes in float32). ``group`` = K gives one scale per token."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, triton.cdiv(k, group), dtype=torch.float32, device=x.device)
    _quantize_groups_kernel[(m, scale.shape[1])](
        x, q, scale, k, group, x.stride(0), q.stride(0), scale.stride(0),
        FP8_MAX=fp8_max, MIN_SCALE=min_scale, BLOCK=min(1024, triton.next_power_of_2(group)),
    )
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _block_fp8_matmul_kernel(
    a_ptr,  # [M, K] e4m3: the activations
    a_s_ptr,  # [M, ceil(K / GROUP_K)] float32: one scale per token per GROUP_K columns
    w_ptr,  # [N, K] e4m3: the weight (nn.Linear layout)
    w_s_ptr,  # [ceil(N / GROUP_N), ceil(K / GROUP_K)] float32: one scale per block
    b_ptr,  # [N] (read only with HAS_BIAS)
    out_ptr,  # [M, N]
    M, N, K, stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    HAS_BIAS: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_DOT: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_scale_rows = w_s_ptr + (n // GROUP_N) * stride_wsn  # [BLOCK_N]: each column's row of block scales
    y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):  # BLOCK_K divides GROUP_K: one scale per row of a, per column of w
        kk = k_start + k
        a = tl.load(a_ptr + m[:, None] * stride_am + kk[None, :], mask=(m[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
        a_s = tl.load(a_s_ptr + m * stride_asm + k_start // GROUP_K, mask=m < M, other=0.0)  # [BLOCK_M]
        w_s = tl.load(w_scale_rows + k_start // GROUP_K, mask=n < N, other=0.0)  # [BLOCK_N]
        if FP8_DOT:
            d = tl.dot(a, tl.trans(w))  # [BLOCK_M, BLOCK_N] float32, on the fp8 tensor cores
        else:  # a K step under 32, which the fp8 MMA does not take: e4m3 values are exact in tf32
            d = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
        y += d * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    mask = (m[:, None] < M) & (n[None, :] < N)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def block_config(m: int, group_k: int) -> dict:
    """Tile shape: the K step is the scale group, at most 128 (groups are powers of two, so
    it divides the group); few rows take the smallest tile the tensor cores allow."""
    return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 128, "BLOCK_K": min(group_k, 128),
            "num_warps": 4, "num_stages": 3}


def block_fp8_matmul(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a_q e4m3 [M, K] with a_s [M, ceil(K / bk)], w_q e4m3 [N, K] with w_s [ceil(N / bn),
    ceil(K / bk)], block = (bn, bk). Returns (a_q * a_s) @ (w_q * w_s)^T (+ bias): [M, N]."""
    m, k = a_q.shape
    n = w_q.shape[0]
    group_n, group_k = block
    if w_q.shape[1] != k or a_s.shape != (m, triton.cdiv(k, group_k)) or w_s.shape != (
            triton.cdiv(n, group_n), triton.cdiv(k, group_k)):
        raise ValueError(f"block_fp8_matmul: a {tuple(a_q.shape)}, scales {tuple(a_s.shape)}; w {tuple(w_q.shape)}, "
                         f"scales {tuple(w_s.shape)}; block {block}: shapes do not agree")
    config = block_config(m, group_k)
    if group_k < 16 or group_k & (group_k - 1):
        raise ValueError(f"block_fp8_matmul needs a K block that is a power of two, at least 16; got {group_k}")
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _block_fp8_matmul_kernel[grid](
        a_q, a_s, w_q, w_s, bias if bias is not None else w_s, out,
        m, n, k, a_q.stride(0), a_s.stride(0), w_q.stride(0), w_s.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, GROUP_N=group_n, GROUP_K=group_k, FP8_DOT=config["BLOCK_K"] >= 32, **config,
    )
    return out
