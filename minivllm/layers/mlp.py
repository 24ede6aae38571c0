"""The gated feed-forward block of every dense decoder layer: down(act(gate(x)) * up(x)).

Gate and up are packed into one column-parallel matrix, down is row-parallel (chapter 16:
one all-reduce per block). Families differ only in the activation: SwiGLU (``silu``:
Llama, Qwen) or GeGLU (``gelu_tanh``: Gemma).
"""
import torch
from torch import nn

from minivllm.layers.activation import ActAndMul
from minivllm.layers.linear import GateUpLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu"):
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size)
        self.act_fn = ActAndMul(activation)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, activation = self.gate_up_proj, self.act_fn.activation
        if gate_up.gated_fuses(x, activation):
            # The gate/up product ending in SwiGLU, one kernel (a few rows on a GPU); the
            # modules' own path (and their hooks) everywhere else.
            return self.down_proj(gate_up.forward_gated(x, activation))
        return self.down_proj(self.act_fn(gate_up(x)))
