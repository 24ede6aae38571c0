"""Asking L2 for the next matrix's weights while this kernel runs (Hopper and later).

At batch 1 a decode step reads every weight once, and each of a layer's four matrix-vector
products (``kernels.gemv``) waits for its own weights to come from HBM: a few microseconds
of a kernel whose launch, first loads and tail are most of its time. Between two products
run small kernels that move almost no bytes (the norms, RoPE, the attention at a short
context), and HBM sits idle under them. A prefetch moves that traffic there: a gemv, once
its own loads are issued, asks L2 for the weights of a product a little further on, and
returns without waiting. When that product runs, its weights come from L2 (50 MB on an
H100 or H200; a layer of Qwen3-0.6B's is 31.5 MB) and its time is its launch and the
arithmetic. The bytes read from HBM are the same; they are read while the GPU would
otherwise wait.

``cp.async.bulk.prefetch.L2`` (PTX, sm_90) takes an address and a size and returns at once:
each thread of each program issues one piece of ``PIECE_BYTES``. A prefetch is a hint:
it changes no result, only where the next kernel's loads find their bytes.

``MINIVLLM_PREFETCH=0`` turns it off, to compare (the engine's ``chain_prefetches`` sets
which weights each layer asks for: ``layers.linear``).
"""
import functools
import os

import torch
import triton
import triton.language as tl

PIECE_BYTES = tl.constexpr(4096)  # what one thread asks for: a multiple of 16 bytes, as the instruction needs
PIECES = tl.constexpr(256)  # pieces a program issues at most: one per thread at 8 warps


@functools.cache
def _prefetch_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def prefetch_enabled(x: torch.Tensor) -> bool:
    """Prefetching on ``x``'s device: a CUDA GPU of compute capability 9 or later (the
    instruction is Hopper's), unless MINIVLLM_PREFETCH=0; never in Triton's interpreter."""
    if not x.is_cuda or os.environ.get("MINIVLLM_PREFETCH", "1") == "0":
        return False
    return _prefetch_capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


@triton.jit
def prefetch_to_l2(ptr, nbytes):
    """This program's share of [ptr, ptr + nbytes) asked of L2, without waiting: piece j
    (PIECE_BYTES each, the partial last one left out) goes to program j % programs. The
    grid's first axis is the programs; a grid too small for every piece leaves the rest."""
    programs = tl.num_programs(0)
    piece = tl.program_id(0) + programs * tl.arange(0, PIECES)  # [PIECES]
    wanted = (piece < nbytes // PIECE_BYTES).to(tl.int32)
    address = ptr.to(tl.pointer_type(tl.int8)) + piece.to(tl.int64) * PIECE_BYTES
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [address, wanted, tl.full([PIECES], PIECE_BYTES, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)
