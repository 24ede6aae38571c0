"""Qwen3.5-MoE (text, ``Qwen3_5MoeForCausalLM``, model_type ``qwen3_5_moe_text``).

Qwen3.5's hybrid decoder (``models.qwen3_5``: Gated DeltaNet layers with a full-attention
layer every few) where every layer's feed-forward is sparse, as transformers builds it:

- a router (``mlp.gate``) scores ``num_experts`` experts; each token goes to the top
  ``num_experts_per_tok``, whose softmax probabilities are always renormalised to sum to
  one (there is no ``norm_topk_prob`` switch in this family);
- beside them, a shared expert (``mlp.shared_expert``, a SwiGLU of
  ``shared_expert_intermediate_size``) that every token goes through, scaled by
  sigmoid(``mlp.shared_expert_gate`` x), one scalar per token;
- no dense layers: ``decoder_sparse_step`` and ``mlp_only_layers`` do not exist here.

Loading: as Qwen3.5, plus the experts (stacked from per-expert tensors or taken whole, as
in Qwen3-MoE) and the shared expert's gate/up packed like a dense MLP's.
"""
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.moe import sparse_moe_block
from minivllm.models.qwen3_5 import Qwen3_5ForCausalLM
from minivllm.models.qwen3_moe import Qwen3MoeForCausalLM


def qwen3_5_moe_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    return sparse_moe_block(config, renormalize=True)  # every layer, the top-k always renormalised


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    expert_modules_mapping = Qwen3MoeForCausalLM.expert_modules_mapping
    make_mlp = staticmethod(qwen3_5_moe_mlp)

    def __init__(self, config: ModelConfig):
        if config.num_experts < 1 or config.shared_expert_intermediate_size < 1:
            raise ValueError(f"{config.architecture} needs num_experts >= 1 and shared_expert_intermediate_size >= 1 "
                             f"in config.json, got {config.num_experts} and {config.shared_expert_intermediate_size}")
        super().__init__(config)
