# Reference copy of minivllm/ops/moe.py, generated from it by scripts/make_exercises.py.
# Reference answers for: experts_reference (ch12), group_by_expert (ch12).
# Do not edit: change minivllm/ops/moe.py and run scripts/make_exercises.py again.

"""Mixture-of-experts ops: run each token through the experts its router chose and mix
the results by the router's weights.

Shapes: x [T, H]; w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows, as in
``GateUpLinear``); w_down [E, H, I]; topk_ids and topk_weights [T, K] (the K experts each
token goes to and their weights). For each token t:

    out[t] = sum over k of topk_weights[t, k] * expert_e(x[t]),   e = topk_ids[t, k]
    expert_e(x) = w_down[e] @ (silu(w_gate[e] @ x) * (w_up[e] @ x))

The reference loops over experts: gather the tokens sent to expert e, run them through its
feed-forward, scatter-add the weighted results back. Readable, but it asks the host, for
every expert, how many tokens it got (a device sync each), and launches three small
matmuls per expert. The fused path (``kernels.fused_moe``) first sorts the T*K (token,
expert) assignments by expert with ``group_by_expert`` and then runs every expert's
matmuls in one launch for gate/up and one for down.

``MINIVLLM_MOE_BACKEND=reference`` keeps the reference on a GPU (to compare the two);
``fused`` (the default) takes the kernels wherever Triton runs.
"""
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.ops.dispatch import use_triton

BACKENDS = ("fused", "reference")


def moe_backend() -> str:
    backend = os.environ.get("MINIVLLM_MOE_BACKEND", "fused")
    if backend not in BACKENDS:
        raise ValueError(f"MINIVLLM_MOE_BACKEND={backend!r}: use one of {BACKENDS}")
    return backend


def fused_experts(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' mixed output for every token, [T, H] in x's dtype (see the module docstring)."""
    check_moe_shapes(x, w_gate_up, w_down, topk_weights, topk_ids)
    if moe_backend() == "fused" and use_triton(x):
        return fused_experts_triton(x, w_gate_up, w_down, topk_weights, topk_ids)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the reference MoE syncs with the host once per expert and cannot be captured "
                           "in a CUDA graph: run with enforce_eager=True")
    return experts_reference(x, w_gate_up, w_down, topk_weights, topk_ids)


def fused_experts_triton(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:
    """The fused path on any device Triton runs on: group the assignments by expert
    (``group_by_expert``), then the two grouped-GEMM launches of ``kernels.fused_moe``.
    ``config`` overrides the kernels' block sizes (``kernels.fused_moe.block_config``)."""
    from minivllm.kernels import fused_moe as kernels

    config = config or kernels.block_config(topk_ids.numel(), w_gate_up.shape[0])
    groups = group_by_expert(topk_ids, w_gate_up.shape[0], config["BLOCK_M"])
    return kernels.fused_moe(x, w_gate_up, w_down, topk_weights, groups.sorted_ids, groups.block_experts, config)


def check_moe_shapes(x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"x must be [tokens, hidden] and the expert weights 3-D, got x {tuple(x.shape)}, "
                         f"w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}")
    tokens, hidden = x.shape
    experts, two_inter, _ = w_gate_up.shape
    if w_gate_up.shape[2] != hidden or two_inter % 2 or w_down.shape != (experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights must be w_gate_up [E, 2I, {hidden}] and w_down [E, {hidden}, I], got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids and topk_weights must both be [{tokens}, top_k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")


def experts_reference(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The spec: one expert at a time, over only the tokens routed to it."""
    out = torch.zeros_like(x)
    for expert in range(w_gate_up.shape[0]):
        # Which tokens chose this expert, and in which of their top-k slots.
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue  # no token chose it this step: its weights are not even read
        gate, up = F.linear(x[token], w_gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[expert])
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(y.dtype))
    return out


# -- grouping tokens by expert, for the fused kernels -----------------------------------


@dataclass
class ExpertGroups:
    """The T*K assignments (assignment a = t * K + k: token t's k-th expert) laid out in
    expert order, each expert's run padded to a multiple of ``block_size`` rows, so every
    block of rows belongs to exactly one expert and one kernel program can multiply it by
    that expert's weights.

    sorted_ids: [capacity] assignment indices; padding rows hold T*K (one past the last).
    block_experts: [capacity // block_size] the expert of each block; -1 past the end.
    """

    sorted_ids: torch.Tensor
    block_experts: torch.Tensor
    block_size: int


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> ExpertGroups:
    """Sort the assignments of ``topk_ids`` ([T, K]) by expert, padding each expert's run.

    Only device ops whose output sizes the host knows in advance (no ``nonzero``, no
    ``.item()``): the step never waits for the GPU here, and a CUDA graph can capture it.
    The buffer is sized for the worst case: at most min(E, T*K) experts are non-empty and
    each wastes fewer than block_size rows of padding.
    """
    flat = topk_ids.flatten()
    num_assignments = flat.numel()
    bound = num_assignments + min(num_experts, num_assignments) * (block_size - 1)
    capacity = (bound + block_size - 1) // block_size * block_size
    ones = torch.ones_like(flat)
    counts = torch.zeros(num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, ones)
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)  # stable: an expert's assignments keep token order
    expert_of_sorted = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # where each expert's run starts in `order`
    rank = torch.arange(num_assignments, device=flat.device) - first_of_expert[expert_of_sorted]
    sorted_ids = torch.full((capacity,), num_assignments, dtype=flat.dtype, device=flat.device)
    sorted_ids[starts[expert_of_sorted] + rank] = order
    # Block b starts at row b * block_size; its expert is the first whose run ends after that.
    block_starts = torch.arange(0, capacity, block_size, device=flat.device, dtype=flat.dtype)
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return ExpertGroups(sorted_ids, block_experts, block_size)
