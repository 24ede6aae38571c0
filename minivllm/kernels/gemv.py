"""y = x W^T for a handful of rows: the matrix-vector products of decode.

At batch 1 every linear layer of a decode step is a matrix times one vector. It does two
FLOPs per weight it reads, so its only cost is streaming W from memory once:
  bytes ~ N * K * dtype_size,  time >= bytes / HBM bandwidth.
General GEMM libraries tile for large M and reach only a fraction of the bandwidth here
(measured in chapter 15); this kernel is shaped for the case instead. Each program owns
BLOCK_N output columns and walks K in BLOCK_K steps; the few rows of x are padded to the
16 that a tensor-core ``tl.dot`` needs (the padding costs no memory traffic, and the
multiply is free next to the load). One row (batch-1 decode), and up to SUM_ROWS rows of a
narrow matrix (a verifying step of speculative decoding: its last token and a few drafts),
are multiplied without the tensor cores, as products summed along K: then a program may
own fewer than 16 columns, and a matrix of 1,024 columns is split over more programs than
the 64 that 16-column blocks give it (the H200 has 132 SMs). Many programs, each with several loads in
flight (``num_stages``), keep the bytes moving. K is not split across programs: that needs a
zeroed float32 buffer and a cast, two more launches, and at these sizes (4-12 MB) a launch's
fixed latency of a few microseconds is most of the time (benchmarks/README.md); chapter 15
measures how close to the roofline this gets.

With Programmatic Dependent Launch (``kernels.pdl``) a gemv's first weight tile is loaded
before it waits for the kernel before it: the weights never depend on an earlier kernel, so
their first bytes stream in while that kernel finishes.

The feed-forward's gate and up projections can end in SwiGLU here (``gemv_silu_and_mul``):
each program computes the same columns of gate and of up and writes silu(gate) * up, so the
[rows, 2I] intermediate and the SiLU-and-mul kernel are gone.

FP8 weights (chapter 20, ``quantization="fp8"``): W may be e4m3 with one float32 scale per
row (``weight_scale``). The kernel reads the byte, widens it to the activations' dtype
in registers (exact: every e4m3 value is a bf16 value) and multiplies the column's sum by
its row's scale once, at the end: W8A16, half the bytes of a bf16 W, the activations
untouched. At decode's few rows those bytes are the whole cost.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.common import dot_precision
from minivllm.kernels.pdl import pdl_options, wait_for_previous

MAX_ROWS = 16  # the largest batch this kernel serves; beyond it, GEMM tiles win
SUM_ROWS = 4  # up to this many rows, narrow matrices default to the sum-of-products path


@triton.jit
def _tile_product(x, w, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed: [BLOCK_M, BLOCK_N] float32.
    On the tensor cores (DOT: BLOCK_M >= 16, the rows padded), or for a few rows as products
    summed along K, which lets a program own fewer than 16 columns."""
    if DOT:  # (an e4m3 w is widened to x's dtype: the tensor cores take one dtype)
        product = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    elif x.shape[0] == 1:  # one row: [BLOCK_N, BLOCK_K] products, summed along K
        product = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    else:  # [BLOCK_M, BLOCK_N, BLOCK_K] products, summed along K
        product = tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
    return product


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,  # [M, K], M <= MAX_ROWS
    w_ptr,  # [N, K] (GATED: [2N, K], the gate's N rows then up's), in x's dtype or e4m3
    b_ptr,  # [N] (read only with HAS_BIAS)
    s_ptr,  # [N] (GATED: [2N]) float32: the e4m3 weight's scale per row (read only with HAS_SCALE)
    out_ptr,  # [M, N]
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, GATED: tl.constexpr, DOT: tl.constexpr, USE_PDL: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n[:, None] * stride_wn
    # The first K tile of the weights is loaded before waiting for the kernel before
    # (which wrote x, not W); the loop takes the rest.
    w = tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
    if GATED:
        w_up = tl.load(w_rows + N * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
    wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
    acc = _tile_product(x, w, DOT, PRECISION)
    if GATED:
        acc_up = _tile_product(x, w_up, DOT, PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + k
        x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=(m[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += _tile_product(x, w, DOT, PRECISION)
        if GATED:
            w_up = tl.load(w_rows + N * stride_wn + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc_up += _tile_product(x, w_up, DOT, PRECISION)
    dtype = out_ptr.dtype.element_ty
    if HAS_SCALE:  # the sum over K of a row times its scale: the scale once per column
        acc *= tl.load(s_ptr + n, mask=n < N, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(s_ptr + N + n, mask=n < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        # As the unfused path computes it: gate and up rounded to the activations' dtype
        # (the gate_up output), then SiLU-and-mul in float32.
        gate = acc.to(dtype).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * acc_up.to(dtype).to(tl.float32)
    mask = (m[:, None] < M) & (n[None, :] < N)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(dtype), mask=mask)


def gemv_config(n: int, k: int, rows: int = 2) -> dict:
    """Block shape per matrix, from scripts/tune_gemv.py on an H200 (chains of 28 matrices
    read from HBM): narrow matrices take thin column blocks (more programs) and long K steps
    (fewer loop trips). One row, and up to SUM_ROWS rows of a matrix narrower than 4,096
    columns, take the sum-of-products path (``DOT``: False), whose blocks may be narrower
    than the tensor cores' 16 (``_tile_product``)."""
    if rows == 1:
        # A program's whole row of W in one tile (K up to 4,096; masked to K), of 8,192
        # elements: loaded before the wait for the kernel before (PDL), so that the weights
        # stream in while it ends and no K loop follows the wait. In the decode graph of
        # Qwen3-0.6B's shapes on an H100, 0.809 ms a replay against 0.867 for 4 x 1,024 tiles
        # walked along K (the sweep's best for each matrix alone, benchmarks/gemv_tuning.json),
        # the greedy tokens identical (benchmarks/README.md, "what moved the decode graph").
        block_k = min(4096, triton.next_power_of_2(k))
        return {"DOT": False, "BLOCK_N": max(1, 8192 // block_k), "BLOCK_K": block_k, "num_warps": 8, "num_stages": 2}
    if rows <= SUM_ROWS and n < 4096:
        # The sweep at 4 rows (benchmarks/gemv_tuning_rows4.json): o_proj 4.06 us and
        # down_proj 5.78 us this way; the wider matrices were fastest on the tensor cores.
        return {"DOT": False, "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 3}
    if n < 4096:
        return {"DOT": True, "BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3}
    return {"DOT": True, "BLOCK_N": 32 if n < 6144 else 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}


def gated_config(n: int, k: int, rows: int = 2) -> dict:
    """Block shape of gemv_silu_and_mul for n output columns (2n weight rows): half the
    column block of the [2n, k] matrix, since each program loads its columns twice."""
    config = gemv_config(2 * n, k, rows)
    if not config["DOT"]:
        # One row: the plain gemv's tile (8 x 1,024 at K = 1,024, as tuned), twice.
        return config if rows == 1 else {**config, "BLOCK_N": 4}
    return {**config, "BLOCK_N": max(16, config["BLOCK_N"] // 2)}


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of width {weight.shape[1]}, got {tuple(x.shape)}")
    if (weight_scale is None) != (weight.dtype != torch.float8_e4m3fn):
        raise ValueError(f"gemv: an e4m3 weight comes with its weight_scale, another one without ({weight.dtype})")
    if weight_scale is not None and weight_scale.numel() != weight.shape[0]:
        raise ValueError(f"gemv: weight_scale needs one scale per row ({weight.shape[0]}), "
                         f"got {tuple(weight_scale.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(x, weight, bias, weight_scale, out, n, gated, config):
    m, k = x.shape
    config = {"DOT": m > SUM_ROWS, **config}  # a config without DOT: the default path for m rows
    if not config["DOT"] and m > 2 * SUM_ROWS:
        raise ValueError(f"DOT=False (the sum-of-products path) takes at most {2 * SUM_ROWS} rows, got {m}")
    if config["DOT"] and config["BLOCK_N"] < 16:
        raise ValueError(f"DOT=True (the tensor cores) needs BLOCK_N >= 16, got {config['BLOCK_N']}")
    _gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, weight_scale if weight_scale is not None else weight, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALE=weight_scale is not None, GATED=gated, PRECISION=dot_precision(x.dtype),
        BLOCK_M=16 if config["DOT"] else triton.next_power_of_2(m), **pdl_options(x), **config,
    )
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         weight_scale: torch.Tensor | None = None, **config) -> torch.Tensor:
    """x: [M, K] with M <= 16, weight: [N, K] (nn.Linear layout), or e4m3 with
    ``weight_scale`` [N, 1] float32. Returns x @ (weight * weight_scale).T (+ bias)."""
    x = _check(x, weight, weight_scale)
    n = weight.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    return _launch(x, weight, bias, weight_scale, out, n, False, config or gemv_config(n, x.shape[1], x.shape[0]))


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                      **config) -> torch.Tensor:
    """x: [M, K] with M <= 16, weight: [2N, K], the gate's rows then up's (GateUpLinear), or
    e4m3 with ``weight_scale`` [2N, 1]. Returns silu(x @ W_gate.T) * (x @ W_up.T): [M, N]."""
    x = _check(x, weight, weight_scale)
    if weight.shape[0] % 2:
        raise ValueError(f"gemv_silu_and_mul needs [gate | up] rows (an even count), got {weight.shape[0]}")
    n = weight.shape[0] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    return _launch(x, weight, None, weight_scale, out, n, True, config or gated_config(n, x.shape[1], x.shape[0]))
