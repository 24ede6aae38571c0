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
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.embed_head import VocabEmbedding
from minivllm.layers.moe import SparseMoeBlock
from minivllm.layers.norm import RMSNorm
from minivllm.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer (and its forward) with the feed-forward picked per layer."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        nn.Module.__init__(self)
        self.self_attn = Qwen3Attention(config)
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                      config.moe_intermediate_size, config.norm_topk_prob)
        else:
            self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeModel(Qwen3Model):
    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


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
