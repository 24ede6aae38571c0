"""One token per row straight from the logits, in one pass: the Gumbel-max trick.

argmax_i (x_i / T + g_i), with g_i independent standard Gumbel noise, is a draw from
softmax(x / T). So a draw needs no float32 copy of the logits, no softmax and no tensor of
noise: each program reads its row once, makes its noise in registers (Philox, keyed by the
row's seed and counted by the token index, so a seed draws the same token wherever its row
sits in the batch; four tokens share one Philox call), and keeps a running argmax. A greedy
row takes argmax_i x_i, the first index of the maximum, as torch.argmax does.

Roofline: reads rows x vocab logits once (at batch 256 and Qwen3's 151,936 tokens, 78 MB of
bf16), writes one int64 per row; the noise and the comparisons are arithmetic in registers.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minivllm.kernels.pdl import pdl_options, wait_for_previous


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    # The GPU's one-instruction approximation (lg2.approx, relative error about 2^-22), or
    # the accurate libdevice routine (some thirty instructions): the noise needs no more
    # precision than its 24-bit uniforms have. Triton's interpreter has only the second.
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _fold(best, best_idx, row_ptr, cols, end, u, greedy, scale, FAST: tl.constexpr):
    """One quarter block of a row into each lane's best: the logits at ``cols`` (those at or
    past ``end`` are not the split's), tempered and given Gumbel noise, or as they are for a
    greedy row. In base 2: x / T - ln(-ln u), divided by ln 2 (which leaves the argmax
    where it is), is x * log2(e) / T - log2(-log2 u) plus a constant; ``scale`` is
    log2(e) / T."""
    x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
    v = tl.where(greedy, x, x * scale - _log2(-_log2(u, FAST), FAST))
    take = (v > best) & (cols < end)
    return tl.where(take, v, best), tl.where(take, cols, best_idx)


# The per-row settings are rows of one small tensor (sampler.rows_to_device), whose offsets
# move with the batch size: no alignment specialisation for them (kernels.common).
@triton.jit(do_not_specialize=["vocab", "split_len"],
            do_not_specialize_on_alignment=["temperature_ptr", "greedy_ptr"])
def _gumbel_argmax_kernel(
    logits_ptr,  # [rows, vocab], any float dtype
    temperature_ptr,  # [rows] float32 (read for the rows that sample)
    greedy_ptr,  # [rows] float32: 1 where the row takes the argmax
    seeds_ptr,  # [rows] int64: each row's noise seed
    best_ptr,  # [rows, SPLITS] float32: each split's best value
    best_idx_ptr,  # [rows, SPLITS] int32: and its first index
    stride, vocab, split_len, BLOCK: tl.constexpr, SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    greedy = tl.load(greedy_ptr + row) != 0
    scale = LOG2E / tl.load(temperature_ptr + row)
    seed = tl.load(seeds_ptr + row)
    # A block of BLOCK logits is four quarters of QUARTER; lane i of each quarter takes one
    # of the four numbers that one Philox call (tl.rand4x, counter start / 4 + i) makes.
    # One call per token (tl.rand) would keep three of every four numbers unused, and the
    # generator's integer work bounded the kernel: 272 us for 256 rows on the H200.
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    # Per lane: the best value seen and its first index (strictly greater replaces). A lane
    # sees its columns in increasing order (quarter by quarter, block by block).
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.full([QUARTER], vocab, tl.int32)
    first, end = split * split_len, tl.minimum(split * split_len + split_len, vocab)
    row_ptr = logits_ptr + row * stride
    for start in range(first, end, BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)  # uniform in [0, 1)
        best, best_idx = _fold(best, best_idx, row_ptr, start + lanes, end, u0, greedy, scale, FAST_LOG)
        best, best_idx = _fold(best, best_idx, row_ptr, start + QUARTER + lanes, end, u1, greedy, scale, FAST_LOG)
        best, best_idx = _fold(best, best_idx, row_ptr, start + 2 * QUARTER + lanes, end, u2, greedy, scale, FAST_LOG)
        best, best_idx = _fold(best, best_idx, row_ptr, start + 3 * QUARTER + lanes, end, u3, greedy, scale, FAST_LOG)
    top = tl.max(best, axis=0)
    # The smallest index among the lanes that hold the maximum: the first maximum overall.
    token = tl.min(tl.where(best == top, best_idx, vocab), axis=0)
    tl.store(best_ptr + row * SPLITS + split, top)
    tl.store(best_idx_ptr + row * SPLITS + split, token)


@triton.jit(do_not_specialize=["vocab", "num_splits"])
def _merge_splits_kernel(
    best_ptr,  # [rows, SPLITS] float32
    best_idx_ptr,  # [rows, SPLITS] int32
    out_ptr,  # [rows] int64
    vocab, num_splits, SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, SPLITS)
    live = lanes < num_splits
    best = tl.load(best_ptr + row * SPLITS + lanes, mask=live, other=float("-inf"))
    idx = tl.load(best_idx_ptr + row * SPLITS + lanes, mask=live, other=vocab)
    top = tl.max(best, axis=0)
    # Splits cover ascending index ranges, so the smallest index holding the maximum is
    # the first maximum of the whole row.
    token = tl.min(tl.where(best == top, idx, vocab), axis=0)
    token = tl.where(token == vocab, 0, token)  # a row of -inf only: index 0, as torch.argmax
    tl.store(out_ptr + row, token.to(tl.int64))


# A row is cut into up to this many slices, one program each, so that a small batch still
# fills the GPU: at batch 1 one program reading 151,936 logits took 107 us on the H200, a
# latency of one SM's bandwidth; cut in 38 slices it is a few microseconds.
TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                  seeds: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab]; temperature, greedy: [rows] float32; seeds: [rows] int64.
    Returns [rows] int64 token ids (see the module docstring)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = 4096 if logits.is_cuda else 64
    blocks = triton.cdiv(vocab, block)
    max_splits = triton.next_power_of_2(min(blocks, 64))
    # Slices of whole blocks: the split count follows the batch (fewer rows, more slices).
    splits = max(1, min(max_splits, triton.cdiv(TARGET_PROGRAMS, max(rows, 1)), blocks))
    split_len = triton.cdiv(blocks, splits) * block
    splits = triton.cdiv(vocab, split_len)
    best = torch.empty(rows, max_splits, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, max_splits, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows, splits)](logits, temperature, greedy, seeds, best, best_idx, logits.stride(0),
                                          vocab, split_len, BLOCK=block, SPLITS=max_splits, num_warps=8,
                                          FAST_LOG=logits.is_cuda, **pdl_options(logits))
    _merge_splits_kernel[(rows,)](best, best_idx, out, vocab, splits, SPLITS=max_splits, **pdl_options(logits))
    return out
