# Reference copy of minivllm/layers/moe.py, generated from it by scripts/make_exercises.py.
# Reference answers for: route (ch12).
# Do not edit: change minivllm/layers/moe.py and run scripts/make_exercises.py again.

"""A sparse mixture-of-experts feed-forward block (Qwen3-MoE).

Instead of one wide feed-forward, the layer holds E small ones (the experts) and a router:
a linear layer that scores every expert for every token. Each token goes through only the
top k of them, and their outputs are mixed by the router's probabilities. Parameters grow
with E; the work per token grows only with k.

The experts' weights are stacked into two 3-D parameters, one matrix per expert, so one
kernel can reach all of them: ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
``down_proj`` [E, H, I]. Checkpoints store them either like that (transformers' fused
layout) or as one tensor per expert and projection (the hub's layout,
``experts.{e}.gate_proj.weight``); the parameters' ``weight_loader`` takes both.
"""
import torch
from torch import nn

from minivllm.layers.linear import Linear, default_weight_loader
from minivllm.ops.moe import fused_experts


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice: (weights, expert ids), both [tokens, top_k], best first.

    Probabilities are a softmax over all experts, taken in float32; the top k are kept,
    and with ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``) rescaled to sum to one.
    The weights come back in the logits' dtype, as transformers rounds them.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class StackedExperts(nn.Module):
    """Every expert's gate/up and down matrices, stacked along a leading expert dim."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # The per-expert pieces the loader must find when a checkpoint stores experts one by one.
        self.gate_up_proj.shard_ids = [(e, part) for e in range(num_experts) for part in (0, 1)]
        self.down_proj.shard_ids = [(e, None) for e in range(num_experts)]
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """shard_id None: the whole stack at once. (expert, part): one expert's matrix, where
        part 0 / 1 is its gate / up half of ``gate_up_proj`` and None its ``down_proj``."""
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: this layer has {self.num_experts} experts")
        target = param.data[expert]
        if part is not None:
            target = target.narrow(0, part * self.intermediate_size, self.intermediate_size)
        if target.shape != loaded_weight.shape:
            raise ValueError(f"expert {expert}: expected shape {tuple(target.shape)}, got {tuple(loaded_weight.shape)}")
        target.copy_(loaded_weight)


class SparseMoeBlock(nn.Module):
    """Route each token to its top-k experts and mix their outputs (no shared expert:
    Qwen3-MoE has none)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts)  # the router (the checkpoint's name for it)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        return fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
