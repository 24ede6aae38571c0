# Exercise copy of minivllm/layers/moe.py, generated from it by scripts/make_exercises.py.
# Fill in: route (ch12), SparseMoeBlock.forward (ch12).
# Grade: make grade CH=12
# Running the generator again overwrites this file: commit or copy your work first.

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

Qwen3.5-MoE adds a shared expert: one more dense feed-forward that every token goes
through, whatever the router says, scaled per token by its own sigmoid gate
(``shared_expert_gate``, one output) and added to the routed experts' mix.

Tensor parallelism (chapter 16): every rank holds every expert, each with a slice of its
intermediate features, split like a dense MLP (gate and up by rows, down by columns), and
the block's output is all-reduced. The other way, whole experts per rank (expert
parallelism), leaves a rank idle when the router sends few tokens to its experts; a slice
of every expert keeps the ranks' work equal whatever the routing, and the router and the
fused kernel stay the same.
"""
import torch
from torch import nn

from minivllm.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_world_size
from minivllm.layers.linear import Linear, split_rows
from minivllm.layers.mlp import GatedMLP
from minivllm.ops.moe import fused_experts


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice: (weights, expert ids), both [tokens, top_k], best first.

    Probabilities are a softmax over all experts, taken in float32; the top k are kept,
    and with ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``) rescaled to sum to one.
    The weights come back in the logits' dtype, as transformers rounds them.
    """
    raise NotImplementedError(
        "ch12: route: each token picks its top_k experts by router probability: the softmax of its "
        "router logits over the experts, in float32. Return the chosen probabilities as weights, "
        "with the experts' ids. With renormalize, the chosen weights are rescaled to sum to one "
        "per token (Qwen3-MoE does; some models do not). Pitfall: a softmax over the chosen logits "
        "alone equals the renormalized weights, not the plain ones, see "
        "notebooks/12_mixture_of_experts.ipynb"
    )


class StackedExperts(nn.Module):
    """Every expert's gate/up and down matrices, stacked along a leading expert dim; under
    tensor parallelism, this rank's slice of each expert's intermediate features."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.full_intermediate_size = num_experts, hidden_size, intermediate_size
        # This rank's features [start, start + intermediate_size) of every expert.
        self.start, intermediate_size = split_rows(intermediate_size, get_tp_rank(), get_tp_world_size())
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
        part 0 / 1 is its gate / up half of ``gate_up_proj`` and None its ``down_proj``.
        Either way, this rank keeps its slice of the intermediate features."""
        E, H, I, n = self.num_experts, self.hidden_size, self.full_intermediate_size, self.intermediate_size
        is_down = param is self.down_proj
        if shard_id is None:
            expected = (E, H, I) if is_down else (E, 2 * I, H)
            if tuple(loaded_weight.shape) != expected:
                raise ValueError(f"expected shape {expected}, got {tuple(loaded_weight.shape)}")
            if is_down:
                param.data.copy_(loaded_weight.narrow(2, self.start, n))
            else:  # [gate | up] rows: this rank's slice of each half
                param.data[:, :n].copy_(loaded_weight.narrow(1, self.start, n))
                param.data[:, n:].copy_(loaded_weight.narrow(1, I + self.start, n))
            return
        expert, part = shard_id
        if not 0 <= expert < E:
            raise ValueError(f"expert {expert} out of range: this layer has {E} experts")
        expected = (H, I) if part is None else (I, H)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expert {expert}: expected shape {expected}, got {tuple(loaded_weight.shape)}")
        if part is None:
            param.data[expert].copy_(loaded_weight.narrow(1, self.start, n))
        else:
            param.data[expert].narrow(0, part * n, n).copy_(loaded_weight.narrow(0, self.start, n))


def sparse_moe_block(config, renormalize: bool) -> "SparseMoeBlock":
    """The block a model config describes. Families differ only in ``renormalize``: always
    in Qwen3.5-MoE, with ``norm_topk_prob`` in Qwen3-MoE and Qwen3-Next."""
    return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                          config.moe_intermediate_size, renormalize,
                          shared_expert_intermediate_size=config.shared_expert_intermediate_size)


class SparseMoeBlock(nn.Module):
    """Route each token to its top-k experts and mix their outputs; with
    ``shared_expert_intermediate_size`` > 0 (Qwen3.5-MoE), add a gated shared expert."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_expert_intermediate_size: int = 0):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts)  # the router (the checkpoint's name for it)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = None
        if shared_expert_intermediate_size:
            # A dense SwiGLU feed-forward that every token goes through (split under tensor
            # parallelism like a dense MLP; its down projection adds the ranks' slices itself).
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, "silu")
            self.shared_expert_gate = Linear(hidden_size, 1)  # one scalar per token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "ch12: the block's forward: route the router's logits (the gate layer) to each token's "
            "experts and weights, mix the experts' outputs (fused_experts), and sum the "
            "tensor-parallel ranks' partial outputs (each rank computed a slice of every expert). "
            "Where the block has a shared expert, every token also goes through it, scaled by its "
            "own gate squashed into (0, 1) by a sigmoid, and the result is added to the routed "
            "mix. Pitfall: the shared expert's gate is per token, one scalar each, not per expert, "
            "see notebooks/12_mixture_of_experts.ipynb"
        )
