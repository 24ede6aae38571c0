"""Fused mixture of experts: every expert's feed-forward in two grouped-GEMM launches.

The T*K (token, expert) assignments arrive sorted by expert, each expert's run padded to
BLOCK_M rows (the op does that: ``ops.moe.group_by_expert``), so each block of rows needs one
expert's weights. One launch computes silu(x W_gate^T) * (x W_up^T) for every block (gate and up
side by side in one program, SiLU-and-mul fused in, writing [T*K, I]); a second multiplies
by W_down and by the router weight of each assignment ([T*K, H]); summing each token's K
rows is the combine.

  reads:  the weights of every expert that got a token (3 * I * H each) + x once per
          assignment + the [T*K, I] intermediate twice
  FLOPs:  2 * T * K * 3 * I * H
So decode (few tokens per expert) is bound by reading the chosen experts' weights, and a
long prefill (every expert busy with many rows) by the matmuls.
"""
import torch
import triton
import triton.language as tl

from minivllm.kernels.common import dot_precision


@triton.jit(do_not_specialize=["num_assignments"])
def _grouped_gemm_kernel(
    a_ptr,  # [T, K] token rows (A_ROW_IS_TOKEN) or [T * top_k, K] assignment rows
    w_ptr,  # [E, N, K], or [E, 2N, K] with GATED (gate rows, then up rows)
    out_ptr,  # [T * top_k, N]: one row per assignment
    sorted_ids_ptr,  # [num_blocks * BLOCK_M]: assignments in expert order, T * top_k for padding
    block_experts_ptr,  # [num_blocks]: each block's expert, -1 past the last
    weights_ptr,  # [T * top_k] router weights (read only with MUL_WEIGHTS)
    num_assignments, N, K, top_k,
    stride_am, stride_we, stride_wn, stride_om,
    A_ROW_IS_TOKEN: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[a, n] for the BLOCK_M sorted assignments a of this program's block and BLOCK_N
    columns n: A[row(a)] @ W[expert, n]^T (with GATED: silu(gate cols n) * (up cols N + n))."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return  # past the last expert's run: the buffer is sized for the worst case
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_assignments  # padding rows compute nothing useful and store nothing
    # Gate/up reads token rows of x (assignment a belongs to token a // top_k); down reads
    # the intermediate, which has one row per assignment.
    a_rows = ids // top_k if A_ROW_IS_TOKEN else ids
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_expert + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_expert + (N + cols[None, :]) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            acc_up += tl.dot(a, w_up, input_precision=PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + ids[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def block_config(num_assignments: int, num_experts: int) -> dict:
    """Block sizes by rows per expert: decode sends each expert a handful of rows, so a
    small BLOCK_M wastes less padding; a long prefill fills big tiles."""
    rows_per_expert = num_assignments / num_experts
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8)


def _grouped_gemm(a, w, out, sorted_ids, block_experts, weights, top_k, a_row_is_token, gated, mul_weights, config):
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    grid = (block_experts.shape[0], triton.cdiv(n, config["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, block_experts, weights,
        weights.numel(), n, k, top_k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_IS_TOKEN=a_row_is_token, GATED=gated, MUL_WEIGHTS=mul_weights,
        PRECISION=dot_precision(a.dtype),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        num_warps=config["num_warps"],
    )


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_experts: torch.Tensor,
    config: dict,
) -> torch.Tensor:
    """The same result as ``ops.moe.experts_reference``, [T, H] in x's dtype, for the
    assignments grouped by expert in blocks of config["BLOCK_M"] rows (``sorted_ids``,
    ``block_experts``: see ``ops.moe.ExpertGroups``)."""
    tokens, hidden = x.shape
    two_inter = w_gate_up.shape[1]
    top_k = topk_weights.shape[1]
    num_assignments = tokens * top_k
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if sorted_ids.numel() != block_experts.numel() * config["BLOCK_M"]:
        raise ValueError(f"sorted_ids ({sorted_ids.numel()} rows) must be block_experts ({block_experts.numel()}) "
                         f"blocks of BLOCK_M={config['BLOCK_M']} rows")
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty(num_assignments, two_inter // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, inter, sorted_ids, block_experts, weights, top_k, True, True, False, config)
    down = torch.empty(num_assignments, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(inter, w_down, down, sorted_ids, block_experts, weights, top_k, False, False, True, config)
    # The combine: each token's K weighted expert outputs, summed (in float32, then rounded).
    return down.view(tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
