# Reference copy of minivllm/ops/token_bitmask.py, generated from it by scripts/make_exercises.py.
# Reference answers for: unpack_bitmask (ch18).
# Do not edit: change minivllm/ops/token_bitmask.py and run scripts/make_exercises.py again.

"""A token bitmask applied to the logits before sampling (chapter 18): the tokens a row's
grammar does not allow next get -inf, in place.

``bitmask`` is [rows, ceil(vocab / 32)] int32: token t is allowed when bit ``t % 32`` of word
``t // 32`` is set (xgrammar's layout, and vLLM's). The torch reference below is the spec;
on a GPU the Triton kernel (``minivllm.kernels.token_bitmask``) does the same in one pass.
"""
import torch

from minivllm.ops.dispatch import use_triton


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool: which tokens each row allows."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # an arithmetic shift: & 1 still reads the bit
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits[r, t] = -inf wherever bitmask row r does not allow t; returns logits."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    return logits.masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The same, by the dispatch rule: the Triton kernel on a CUDA tensor."""
    rows, vocab = logits.shape
    if bitmask.shape != (rows, (vocab + 31) // 32) or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [{rows}, {(vocab + 31) // 32}] for logits {tuple(logits.shape)}, "
                         f"got {bitmask.dtype} {tuple(bitmask.shape)}")
    if use_triton(logits):
        from minivllm.kernels.token_bitmask import apply_token_bitmask as kernel

        return kernel(logits, bitmask)
    return apply_token_bitmask_reference(logits, bitmask)
