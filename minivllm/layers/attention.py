"""The attention layer: stores this step's keys and values, then attends.

It owns views into the KV cache (``k_cache``, ``v_cache``), handed to it by whoever
allocates the cache, and reads the step's metadata from the shared Context.
"""
import torch
from torch import nn

from minivllm.context import get_context
from minivllm.ops.attention import varlen_attention


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Local attention: each query sees only the last sliding_window positions up to its own.
        self.sliding_window = sliding_window
        # Empty until a cache is attached: then [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]."""
        return varlen_attention(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale, self.sliding_window)


def attention_layers(model: nn.Module) -> list[Attention]:
    """Every attention layer of a model, in order: the layers a KV cache is attached to."""
    return [m for m in model.modules() if isinstance(m, Attention)]
