"""The Gated DeltaNet layer: linear attention with a fixed-size state per sequence.

From the layer's input, one packed projection makes
  qkv  [key_dim | key_dim | value_dim] channels, mixed over the last few tokens by a causal
       depthwise convolution (width K = 4) and a SiLU, then split into queries, keys, values;
  z    the output gate, one value_dim vector per token;
  b    the write strength beta = sigmoid(b), one per value head;
  a    the decay: g = -exp(A_log) * softplus(a + dt_bias) (log space, <= 0), per value head.
The gated delta rule (``minivllm.ops.gated_delta``) turns q, k, v, g, beta into one output
vector per value head; a gated RMSNorm (norm(o) * weight * silu(z)) and ``out_proj`` bring
it back to the hidden size.

What a sequence carries from step to step is two small tensors per layer, whatever its
length: the conv state (its last K - 1 qkv inputs) and the recurrent state (a
[key_dim, value_dim] matrix per value head, float32). The engine gives each running
sequence a slot in ``conv_states`` / ``recurrent_states`` (``minivllm.engine.state_pool``).
Under speculative decoding the layer also has ``spec_conv_states`` / ``spec_recurrent_states``,
k states per slot: a verifying step keeps there the states after each draft it computes,
so that a rejection can go back to the state after the last accepted one.
"""
import torch
import torch.nn.functional as F
from torch import nn

from minivllm.context import get_context
from minivllm.layers.linear import Linear, PackedLinear, replicated_shards
from minivllm.ops.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times silu(gate); statistics and gate in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int = 4, eps: float = 1e-6):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads ({num_v_heads}) must be a multiple of linear_num_key_heads ({num_k_heads})")
        if conv_kernel_size < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {conv_kernel_size}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.in_proj = PackedLinear(hidden_size, replicated_shards(
            {"qkv": self.conv_dim, "z": self.value_dim, "b": num_v_heads, "a": num_v_heads}))
        # Stored as [D, 1, K] like nn.Conv1d's weight (so the checkpoint loads as it is).
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel_size))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size)
        # Empty until the engine attaches its pools: [slots, conv_dim, K - 1] (model dtype)
        # and [slots, num_v_heads, head_k_dim, head_v_dim] (float32).
        self.conv_states: torch.Tensor | None = None
        self.recurrent_states: torch.Tensor | None = None
        # Speculative decoding: [slots, k, ...] of each (None without).
        self.spec_conv_states: torch.Tensor | None = None
        self.spec_recurrent_states: torch.Tensor | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The per-sequence (conv, recurrent) state shapes: fixed, whatever the context length."""
        return (self.conv_dim, self.conv_kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_tokens, hidden_size], sequences packed as the Context says."""
        ctx = get_context()
        qkv, z, b, a = self.in_proj(hidden_states).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        qkv = causal_conv1d_varlen(qkv, self.conv1d.weight[:, 0], self.conv_states, ctx, self.spec_conv_states)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(-1, self.num_k_heads, self.head_k_dim)
        k = k.view(-1, self.num_k_heads, self.head_k_dim)
        v = v.view(-1, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid().float()  # in the model's dtype first, as transformers
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = gated_delta_rule_varlen(q, k, v, g, beta, self.recurrent_states, ctx, self.spec_recurrent_states)
        out = self.norm(out, z.view(-1, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.flatten(1))


def state_layers(model: nn.Module) -> list[GatedDeltaNet]:
    """Every Gated DeltaNet layer of a model, in order: the layers a state slot pool is attached to."""
    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
