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
    # BEGIN SOLUTION ch04 kv_cache_bytes
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * num_tokens * itemsize
    # END SOLUTION


class ContiguousKVCache:
    """One [batch, max_len, kv_heads, head_dim] key and value tensor per layer."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int):
        # BEGIN SOLUTION ch04 contiguous_cache
        layers = attention_layers(model)
        param = next(model.parameters())
        first = layers[0]
        shape = (len(layers), 2, batch_size, max_len, first.num_kv_heads, first.head_dim)
        self.kv = torch.zeros(shape, dtype=param.dtype, device=param.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv[i, 0], self.kv[i, 1]
        self.layers, self.batch_size, self.max_len = layers, batch_size, max_len
        # END SOLUTION

    def detach(self) -> None:
        # BEGIN SOLUTION ch04 detach
        for layer in self.layers:
            layer.k_cache = layer.v_cache = None
        # END SOLUTION

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
        # BEGIN SOLUTION ch04 generate_loop
        input_ids = torch.tensor([t for p in prompts for t in p], device=device)
        positions = torch.tensor([t for n in lens for t in range(n)], device=device)
        slots = torch.tensor([i * max_len + t for i, n in enumerate(lens) for t in range(n)], device=device)
        cu = torch.tensor([0] + lens, device=device).cumsum(0)
        set_context(
            is_prefill=True, cu_seqlens_q=cu.int(), slot_mapping=slots,
            context_lens=torch.tensor(lens, device=device, dtype=torch.int32),
            block_tables=block_tables.int(), max_seqlen_q=max(lens), max_context_len=max(lens),
        )
        next_tokens = model.compute_logits(model(input_ids, positions)).argmax(-1)
        done = [False] * batch
        for _ in range(max_new_tokens):
            for i, tok in enumerate(next_tokens.tolist()):
                if not done[i]:
                    outputs[i].append(tok)
                    done[i] = tok == eos_token_id or len(outputs[i]) == max_new_tokens
            if all(done):
                break
            # Decode: one token per sequence (finished ones keep stepping; their output is ignored).
            positions = torch.tensor(lens, device=device)
            slots = torch.arange(batch, device=device) * max_len + positions
            lens = [n + 1 for n in lens]
            set_context(
                is_prefill=False, cu_seqlens_q=torch.arange(batch + 1, device=device, dtype=torch.int32),
                slot_mapping=slots, context_lens=torch.tensor(lens, device=device, dtype=torch.int32),
                block_tables=block_tables.int(), max_seqlen_q=1, max_context_len=max(lens),
            )
            next_tokens = model.compute_logits(model(next_tokens, positions)).argmax(-1)
        # END SOLUTION
    finally:
        reset_context()
        cache.detach()
    return outputs
