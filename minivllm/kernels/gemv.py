"""y = x W^T for a handful of rows: the matrix-vector products of decode.

At batch 1 every linear layer of a decode step is a matrix times one vector. It does two
FLOPs per weight it reads, so its only cost is streaming W from memory once:
  bytes ~ N * K * dtype_size,  time >= bytes / HBM bandwidth.
General GEMM libraries tile for large M and reach only a fraction of the bandwidth here
(measured in chapter 15); this kernel is shaped for the case instead. Each program owns
BLOCK_N output columns and walks K in BLOCK_K steps; the few rows of x are padded to the
16 that a tensor-core ``tl.dot`` needs (the padding costs no memory traffic, and the
multiply is free next to the load). Many programs, each with several loads in flight
(``num_stages``), keep enough bytes moving to saturate HBM. Optionally SPLIT_K programs
share one column block, each summing a slice of K, and add their partial sums atomically
into a float32 output: narrow matrices (N of a thousand) then still cover every SM.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.paged_attention import dot_precision

MAX_ROWS = 16  # the largest batch this kernel serves; beyond it, GEMM tiles win


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        if pid_k == 0:  # added once, by the first slice of K
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    mask = (m[:, None] < M) & (n[None, :] < N)
    ptrs = out_ptr + m[:, None] * stride_om + n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


def gemv_config(n: int, k: int) -> dict:
    """Block shape per matrix: narrow matrices split K so that every SM gets work."""
    block_n = 32 if n >= 4096 else 16
    split_k = max(1, min(4, 256 // triton.cdiv(n, block_n)))
    return {"BLOCK_N": block_n, "BLOCK_K": 256, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 4}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **config) -> torch.Tensor:
    """x: [M, K] with M <= 16, weight: [N, K] (nn.Linear layout). Returns x @ weight.T (+ bias)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of width {weight.shape[1]}, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    config = config or gemv_config(n, k)
    split_k = config["SPLIT_K"]
    # Split-K partial sums meet in a float32 buffer (atomics), cast back once at the end.
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config["BLOCK_N"]), split_k)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype), BLOCK_M=16, **config,
    )
    return out.to(x.dtype) if split_k > 1 else out
