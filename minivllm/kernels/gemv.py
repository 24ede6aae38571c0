"""y = x W^T for a handful of rows: the matrix-vector products of decode.

At batch 1 every linear layer of a decode step is a matrix times one vector. It does two
FLOPs per weight it reads, so its only cost is streaming W from memory once:
  bytes ~ N * K * dtype_size,  time >= bytes / HBM bandwidth.
General GEMM libraries tile for large M and reach only a fraction of the bandwidth here
(measured in chapter 15); this kernel is shaped for the case instead. Each program owns
BLOCK_N output columns and walks K in BLOCK_K steps; the few rows of x are padded to the
16 that a tensor-core ``tl.dot`` needs (the padding costs no memory traffic, and the
multiply is free next to the load). Many programs, each with several loads in flight
(``num_stages``), keep the bytes moving. K is not split across programs: that needs a
zeroed float32 buffer and a cast, two more launches, and at these sizes (4-12 MB) a launch's
fixed latency of a few microseconds is most of the time (benchmarks/README.md); chapter 15
measures how close to the roofline this gets.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.common import dot_precision

MAX_ROWS = 16  # the largest batch this kernel serves; beyond it, GEMM tiles win


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,  # [M, K], M <= MAX_ROWS
    w_ptr,  # [N, K]
    b_ptr,  # [N] (read only with HAS_BIAS)
    out_ptr,  # [M, N]
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    mask = (m[:, None] < M) & (n[None, :] < N)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_config(n: int, k: int) -> dict:
    """Block shape per matrix, from scripts/tune_gemv.py on an H200: narrow matrices take
    thin column blocks (more programs) and long K steps (fewer loop trips)."""
    if n < 4096:
        return {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 32 if n < 6144 else 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **config) -> torch.Tensor:
    """x: [M, K] with M <= 16, weight: [N, K] (nn.Linear layout). Returns x @ weight.T (+ bias)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of width {weight.shape[1]}, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    config = config or gemv_config(n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype), BLOCK_M=16, **config,
    )
    return out
