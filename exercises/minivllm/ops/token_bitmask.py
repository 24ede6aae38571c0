# Exercise copy of minivllm/ops/token_bitmask.py, generated from it by scripts/make_exercises.py.
# Fill in: unpack_bitmask (ch18).
# Grade: make grade CH=18
# Running the generator again overwrites this file: commit or copy your work first.

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
    raise NotImplementedError(
        "ch18: unpack_bitmask: each row of bitmask packs a vocabulary's allowed flags into int32 "
        "words, token t as bit t % 32 of word t // 32 (bit 0 the lowest). Return a [rows, "
        "vocab_size] boolean mask: expand every word into its 32 bits, lowest first, put the "
        "words' bits end to end, and cut to vocab_size columns. Pitfall: int32 shifts are "
        "arithmetic (a set sign bit copies itself rightwards), so after a shift keep only the "
        "lowest bit, see notebooks/18_structured_output.ipynb"
    )


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
