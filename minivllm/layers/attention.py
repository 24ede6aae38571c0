"""The attention layer: stores this step's keys and values, then attends.

It owns views into the KV cache (``k_cache``, ``v_cache``), handed to it by whoever
allocates the cache, and reads the step's metadata from the shared Context. The cache's
dtype is the cache's own business: a float8 cache (chapter 20) stores key / k_scale and
value / v_scale, and the attention op folds the scales back in, so nothing in the step
knows which dtype the cache holds.
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
        # A float8 cache's scales, one for all of this layer's keys and one for its values
        # (vLLM's k_scale / v_scale): the cache holds k / k_scale. Per tensor, not per head:
        # e4m3 has the same relative precision (3 mantissa bits) anywhere in its normal
        # range, so a scale only has to keep |k| / k_scale below 448 and above the
        # subnormals (2^-6), a span of 2^15 that the keys of an RMS-normed layer sit in
        # whatever their head; a per-head scale would buy little. 1.0 unless the checkpoint
        # gives them (``*.k_scale``, ``*.v_scale``).
        # Buffers, so they follow the model to its device and a CUDA graph reads them by
        # address; a bf16 cache never reads them.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) casts every floating buffer: the scales stay float32.
        super()._apply(fn, recurse)
        self.k_scale, self.v_scale = self.k_scale.float(), self.v_scale.float()
        return self

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]."""
        return varlen_attention(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale, self.sliding_window,
                                self.k_scale, self.v_scale)


def attention_layers(model: nn.Module) -> list[Attention]:
    """Every attention layer of a model, in order: the layers a KV cache is attached to."""
    return [m for m in model.modules() if isinstance(m, Attention)]

