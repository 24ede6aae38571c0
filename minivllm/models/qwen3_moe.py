"""Qwen3-MoE (``Qwen3MoeForCausalLM``, model_type ``qwen3_moe``).

Qwen3's decoder (grouped-query attention with q/k norm) with a sparse feed-forward: in
every ``decoder_sparse_step``-th layer, except those listed in ``mlp_only_layers``, the
MLP is a router and ``num_experts`` small experts (``layers.moe.SparseMoeBlock``), each
token using ``num_experts_per_tok`` of them. The other layers keep one dense MLP of
``intermediate_size``. There is no shared expert in this family. The model is Qwen3's,
whose decoder layers pick their feed-forward by this rule (``models.qwen3.feed_forward``).

Loading: q/k/v and a dense layer's gate/up are packed as in Qwen3; the experts' per-expert
tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight`` are stacked into the layer's 3-D
parameters (``expert_modules_mapping`` tells the loader which piece goes where).
"""
from minivllm.config import ModelConfig
from minivllm.models.qwen3 import Qwen3ForCausalLM


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
