"""Qwen3-MoE (``Qwen3MoeForCausalLM``, model_type ``qwen3_moe``).

Qwen3's decoder (grouped-query attention with q/k norm) with a sparse feed-forward: in
every ``decoder_sparse_step``-th layer, except those listed in ``mlp_only_layers``, the
MLP is a router and ``num_experts`` small experts (``layers.moe.SparseMoeBlock``), each
token using ``num_experts_per_tok`` of them. The other layers keep one dense MLP of
``intermediate_size``. There is no shared expert in this family.

Loading: q/k/v and a dense layer's gate/up are packed as in Qwen3; the experts' per-expert
tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight`` are stacked into the layer's 3-D
parameters (``expert_modules_mapping`` tells the loader which piece goes where).
"""
from functools import partial

from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.moe import sparse_moe_block
from minivllm.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model


def qwen3_moe_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s feed-forward: sparse where ``config.is_moe_layer`` says so (the
    router renormalising with ``norm_topk_prob``), dense elsewhere."""
    if config.is_moe_layer(layer_idx):
        return sparse_moe_block(config, renormalize=config.norm_topk_prob)
    return Qwen3MLP(config)


class Qwen3MoeModel(Qwen3Model):
    """Qwen3's stack (and its layers' forward) with the feed-forward picked per layer."""

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Qwen3DecoderLayer(config, partial(qwen3_moe_mlp, layer_idx=layer_idx))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # checkpoint projection of one expert -> (our stacked parameter, part of it)
    expert_modules_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "down_proj": ("down_proj", None),
    }

    def __init__(self, config: ModelConfig):
        if config.num_experts < 1:
            raise ValueError(f"{config.architecture} needs num_experts >= 1 in config.json, got {config.num_experts}")
        if config.hf_config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported for Qwen3-MoE")
        super().__init__(config)

    def make_model(self, config: ModelConfig) -> nn.Module:
        return Qwen3MoeModel(config)
