"""Qwen3-Next (``Qwen3NextForCausalLM``, model_type ``qwen3_next``): Qwen3.5-MoE's predecessor.

The computation is Qwen3.5-MoE's (``models.qwen3_5``, ``models.qwen3_5_moe``): Gated
DeltaNet layers with a full-attention layer every few, the same gated attention, the same
``1 + weight`` RMSNorms, routed experts beside a sigmoid-gated shared expert. It differs in
two places only:

- the checkpoint packs the Gated DeltaNet in-projections by key-head group: two tensors,
  ``in_proj_qkvz`` holding for each of the ``linear_num_key_heads`` groups its rows
  [q | k | v | z] (v and z for the group's num_value_heads / num_key_heads value heads) and
  ``in_proj_ba`` holding [b | a] per group, where Qwen3.5 stores four tensors, each of all
  heads in order. Loading regroups the rows (``Qwen3NextGatedDeltaNet``); the layer itself
  is unchanged;
- which feed-forwards are sparse is Qwen3-MoE's rule (``decoder_sparse_step`` and
  ``mlp_only_layers``, a dense MLP of ``intermediate_size`` elsewhere), and the router
  renormalises its top-k probabilities only with ``norm_topk_prob``.
"""
import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.gated_deltanet import GatedDeltaNet
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5Model
from minivllm.models.qwen3_moe import Qwen3MoeForCausalLM


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """The Gated DeltaNet layer, loading its packed ``in_proj`` ([qkv | z | b | a], each of
    all heads in order) from Qwen3-Next's two tensors grouped by key head."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_proj.weight.weight_loader = self.load_grouped
        self.in_proj.weight.shard_ids = ["qkvz", "ba"]

    def load_grouped(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        groups, hidden = self.num_k_heads, param.shape[1]
        per_key_head = self.num_v_heads // self.num_k_heads  # value heads in a group
        if shard_id == "qkvz":
            sizes = {"q": self.head_k_dim, "k": self.head_k_dim,
                     "v": per_key_head * self.head_v_dim, "z": per_key_head * self.head_v_dim}
        elif shard_id == "ba":
            sizes = {"b": per_key_head, "a": per_key_head}
        else:
            raise ValueError(f"unknown shard {shard_id!r}; Qwen3-Next's in-projections are 'qkvz' and 'ba'")
        expected = (groups * sum(sizes.values()), hidden)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"shard {shard_id!r}: expected shape {expected}, got {tuple(loaded_weight.shape)}")
        # [group, its rows, hidden] -> for each part, every group's rows in head order.
        by_group = loaded_weight.view(groups, -1, hidden).split(list(sizes.values()), dim=1)
        parts = {name: rows.reshape(-1, hidden) for name, rows in zip(sizes, by_group)}
        if shard_id == "qkvz":
            parts = {"qkv": torch.cat([parts["q"], parts["k"], parts["v"]]), "z": parts["z"]}
        for name, rows in parts.items():
            self.in_proj.weight_loader(param, rows, name)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    packed_modules_mapping = {
        **Qwen3ForCausalLM.packed_modules_mapping,
        "in_proj_qkvz": ("in_proj", "qkvz"),
        "in_proj_ba": ("in_proj", "ba"),
    }
    expert_modules_mapping = Qwen3MoeForCausalLM.expert_modules_mapping

    def __init__(self, config: ModelConfig):
        if config.num_experts and config.shared_expert_intermediate_size < 1:
            raise ValueError(f"{config.architecture} needs shared_expert_intermediate_size >= 1 in config.json, "
                             f"got {config.shared_expert_intermediate_size}")
        super().__init__(config)

    def make_model(self, config: ModelConfig) -> nn.Module:
        # Qwen3.5's stack, and its default feed-forward rule: Qwen3-MoE's.
        return Qwen3_5Model(config, make_mlp=self.make_mlp, linear_attention=Qwen3NextGatedDeltaNet)
