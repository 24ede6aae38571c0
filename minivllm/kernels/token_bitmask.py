"""Apply a token bitmask to the logits, in place: logits[r, t] = -inf where bit t % 32 of
bitmask[r, t // 32] is clear.

Memory-bound and small: it reads the mask (rows * vocab / 8 bytes) and writes only the
masked logits (at most rows * vocab * 4 bytes); no FLOPs to speak of. At a batch of 256 and a
151,936-token vocabulary that is 4.9 MB read and up to 156 MB written: tens of microseconds on
an H200, against a decode step of milliseconds. One program per (row, block of BLOCK tokens);
the 32 lanes that read one word share a cache line.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens per program: 32 words of the mask


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [rows, vocab] float, written in place
    bitmask_ptr,  # [rows, ceil(vocab / 32)] int32
    stride_logits, stride_mask, vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    words = tl.load(bitmask_ptr + row * stride_mask + tokens // 32, mask=in_vocab, other=-1)
    allowed = (words >> (tokens % 32)) & 1
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("logits and bitmask must be contiguous in their last dimension")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}")
    if rows:
        grid = (rows, triton.cdiv(vocab, BLOCK))
        _apply_token_bitmask_kernel[grid](logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, BLOCK=BLOCK)
    return logits
