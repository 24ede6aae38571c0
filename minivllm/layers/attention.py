"""The attention layer: stores this step's keys and values, then attends.

It owns views into the KV cache (``k_cache``, ``v_cache``), handed to it by whoever
allocates the cache, and reads the step's metadata from the shared Context. The cache's
dtype is the cache's own business: a float8 cache (chapter 20) stores key / k_scale and
value / v_scale, and the attention op folds the scales back in, so nothing in the step
knows which dtype the cache holds.
"""
import torch
from torch import distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from minivllm.context import get_context
from minivllm.distributed.parallel_state import get_tp_world_size
from minivllm.ops.attention import FP8_MAX, varlen_attention

# The smallest scale calculate_kv_scales sets: a layer whose keys are all zero would get 0,
# and a cache divides by its scale. Zeros are stored as zeros at any scale.
MIN_KV_SCALE = 1e-6


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
        # gives them (``*.k_scale``, ``*.v_scale``) or calculate_kv_scales measures them
        # (``calculate_kv_scales_on_next_store``).
        # Buffers, so they follow the model to its device and a CUDA graph reads them by
        # address; a bf16 cache never reads them.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        # calculate_kv_scales: the one-shot hook that sets the scales from the next keys
        # and values stored, None when none is waiting (``calculate_kv_scales_on_next_store``).
        self.kv_scales_hook: RemovableHandle | None = None

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) casts every floating buffer: the scales stay float32.
        super()._apply(fn, recurse)
        self.k_scale, self.v_scale = self.k_scale.float(), self.v_scale.float()
        return self

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]."""
        return varlen_attention(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale, self.sliding_window,
                                self.k_scale, self.v_scale)

    def calculate_kv_scales_on_next_store(self) -> None:
        """Set ``k_scale`` and ``v_scale`` from the keys and values of the next forward pass
        that stores any (vLLM's calculate_kv_scales): a forward pre-hook, so it runs before
        that pass's own keys are stored, and removes itself once it has fired, so that no
        later step pays for it. A pass without a cache (a warm-up) stores nothing and is
        not counted. The model runner arms it after its start-up passes of dummy tokens."""
        self.kv_scales_hook = self.register_forward_pre_hook(_set_kv_scales_from_first_store)


def kv_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale that fits ``x`` into e4m3: its largest magnitude maps to 448,
    e4m3's largest value (at least MIN_KV_SCALE). Under tensor parallelism each rank holds
    some of the heads: the largest over the ranks, so every rank stores with the same scale.
    (vLLM divides by 200 for keys and 100 for values instead, leaving headroom for later
    prompts whose keys are larger than the first one's; here later keys past the first
    prompt's largest saturate at 448.)"""
    amax = x.abs().amax().float()
    if get_tp_world_size() > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return (amax / FP8_MAX).clamp(min=MIN_KV_SCALE)


def _set_kv_scales_from_first_store(layer: Attention, args: tuple[torch.Tensor, ...]) -> None:
    """``calculate_kv_scales_on_next_store``'s hook: ``args`` are the forward's q, k, v."""
    _, k, v = args
    if layer.k_cache is None or get_context().slot_mapping is None:
        return  # nothing is stored in this pass: wait for one that stores
    # In place: a CUDA graph captured at start-up reads the scales by address.
    layer.k_scale.copy_(kv_scale(k))
    layer.v_scale.copy_(kv_scale(v))
    layer.kv_scales_hook.remove()
    layer.kv_scales_hook = None


def attention_layers(model: nn.Module) -> list[Attention]:
    """Every attention layer of a model, in order: the layers a KV cache is attached to."""
    return [m for m in model.modules() if isinstance(m, Attention)]

