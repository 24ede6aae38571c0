"""Gated activations for the feed-forward block: act(gate) * up, the math in ``ops.activation``."""
import torch
from torch import nn

from minivllm.ops.activation import ACTIVATIONS, act_and_mul


class ActAndMul(nn.Module):
    """x holds [gate | up]; returns act(gate) * up (``silu``: SwiGLU, ``gelu_tanh``: GeGLU)."""

    def __init__(self, activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_mul(x, self.activation)


class SiluAndMul(ActAndMul):
    """SwiGLU's gate: silu(gate) * up."""

    def __init__(self):
        super().__init__("silu")
