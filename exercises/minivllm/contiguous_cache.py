# Exercise copy of minivllm/contiguous_cache.py, generated from it by scripts/make_exercises.py.
# Fill in: kv_cache_bytes (ch04), ContiguousKVCache.__init__ (ch04), ContiguousKVCache.detach (ch04), generate (ch04).
# Grade: make grade CH=04
# Running the generator again overwrites this file: commit or copy your work first.

"""A minimal generation loop with a contiguous KV cache.

Each sequence gets one row of ``max_len`` slots in the cache, reserved up front, whether it
uses them or not. Chapter 04 measures what that wastes and chapter 05 replaces it with
paged blocks. In the language of blocks, this cache is one block of ``max_len`` tokens per
sequence, so the same attention op serves both.
"""
import torch
from torch import nn

from minivllm.context import reset_context, set_context
from minivllm.layers.attention import attention_layers


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache that ``num_tokens`` tokens occupy: a key and a value vector per
    token, per key/value head, per layer. The one formula behind every memory budget."""
    raise NotImplementedError(
        "ch04: kv_cache_bytes: the memory a contiguous cache of num_tokens tokens takes: every "
        "layer keeps, for every token, a key vector and a value vector of head_dim elements per "
        "key/value head. Count the elements, then multiply by the size in bytes of one element of "
        "dtype (ask torch rather than tabulating dtypes). Pitfall: the query heads are not cached, "
        "only the num_kv_heads key/value heads: that is where grouped-query attention saves "
        "memory, see notebooks/04_kv_cache.ipynb"
    )


class ContiguousKVCache:
    """One [batch, max_len, kv_heads, head_dim] key and value tensor per layer."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int):
        raise NotImplementedError(
            "ch04: the contiguous cache: one tensor for the keys and values of every attention "
            "layer, an axis for the layers, one of two for key and value, then batch_size rows of "
            "max_len slots, each of the first layer's kv heads by head_dim; zeros, in the model's "
            "dtype and on its device; every layer's k_cache and v_cache are views of its two "
            "halves (the attention op writes and reads through them). Keep the layers, batch_size "
            "and max_len. Pitfall: a copy instead of a view leaves the attention writing into a "
            "tensor nobody reads, see notebooks/04_kv_cache.ipynb"
        )

    def detach(self) -> None:
        raise NotImplementedError(
            "ch04: detach: take the cache off every layer, keys and values, so the layers hold no "
            "reference to it and attend without a cache again, see notebooks/04_kv_cache.ipynb"
        )

    def nbytes(self) -> int:
        """Bytes reserved: every row's ``max_len`` slots, used or not."""
        return self.kv.numel() * self.kv.element_size()

    def bytes_per_token(self) -> int:
        first = self.layers[0]
        return kv_cache_bytes(len(self.layers), first.num_kv_heads, first.head_dim, 1, self.kv.dtype)


@torch.inference_mode()
def generate(
    model: nn.Module, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None = None
) -> list[list[int]]:
    """Greedy continuation of each prompt (token ids). Returns the new tokens only."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    device = next(model.parameters()).device
    max_len = max(len(p) for p in prompts) + max_new_tokens
    limit = model.config.max_position_embeddings
    if max_len > limit:
        raise ValueError(f"prompt + max_new_tokens = {max_len} tokens exceeds max_position_embeddings={limit}")
    batch = len(prompts)
    cache = ContiguousKVCache(model, batch, max_len)
    # Row i of the cache is "block" i; slot of token t of sequence i is i * max_len + t.
    block_tables = torch.arange(batch, device=device)[:, None]
    lens = [len(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    try:
        # Prefill: every prompt token of every sequence in one flat batch.
        raise NotImplementedError(
            "ch04: generate, the loop: row i of the cache is sequence i's block, so token t of "
            "sequence i lives in slot i times max_len plus t. Prefill: all prompt tokens of all "
            "sequences in one flat batch, with their positions, slots, cumulative lengths "
            "(cu_seqlens_q, starting at 0) and context lengths, set as the step's context "
            "(set_context; is_prefill, the block tables, the longest prompt as max_seqlen_q and "
            "max_context_len), and the next token of each sequence is the argmax of its last "
            "logits. Then up to max_new_tokens times: give each unfinished sequence its token and "
            "mark it done at eos_token_id or at max_new_tokens tokens; stop when all are done; "
            "otherwise a decode step: one token per sequence at position its current length, its "
            "slot, lengths one longer, one query each. Pitfalls: a position off by one still runs "
            "and drifts; finished sequences keep stepping but gain no tokens, see "
            "notebooks/04_kv_cache.ipynb"
        )
    finally:
        reset_context()
        cache.detach()
    return outputs
