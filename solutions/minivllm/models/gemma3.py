# Reference copy of minivllm/models/gemma3.py, generated from it by scripts/make_exercises.py.
# Reference answers for: Gemma3DecoderLayer.__init__ (ch11), Gemma3DecoderLayer.forward (ch11), Gemma3ForCausalLM.compute_logits (ch11).
# Do not edit: change minivllm/models/gemma3.py and run scripts/make_exercises.py again.

"""Gemma 3, text only (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

The same grouped-query decoder as Qwen3 (q/k/v and gate/up packed the same way, and
Qwen3's attention layer with Gemma's settings), with Gemma's differences:

- RMSNorm scales by ``1 + weight`` (the weights are stored centred on zero), and the
  whole norm, the scaling included, is computed in float32 before casting back;
- four norms per layer: the attention and feed-forward outputs are normalised too
  (post_attention / post_feedforward) before they join the residual stream;
- GeGLU feed-forward: gelu_tanh(gate) * up;
- token embeddings multiplied by sqrt(hidden_size) (the factor cast to the model dtype);
- attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- local layers: most layers attend over a sliding window only (``layer_types``), with their
  own RoPE base; the global layers use ``rope_theta`` and the RoPE scaling;
- optional final logit softcapping: tanh(logits / cap) * cap.
"""
import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.embed_head import ScaledVocabEmbedding
from minivllm.layers.mlp import GatedMLP
from minivllm.layers.norm import GemmaRMSNorm
from minivllm.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        sliding = bool(config.layer_types) and config.layer_types[layer_idx] == "sliding_attention"
        self.self_attn = Qwen3Attention(config, qk_norm=GemmaRMSNorm, sliding=sliding)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, "gelu_tanh")
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # Each sub-block's output is normalised before it is added to the residual stream,
        # so there is no norm to fuse the add into: the adds stay plain, as in transformers.
        attn_out = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp_out)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = ScaledVocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class Gemma3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig):
        if config.hf_config.get("attn_logit_softcapping") is not None:
            raise ValueError("attention logit softcapping (Gemma 2) is not supported")
        if config.hf_config.get("use_bidirectional_attention"):
            raise ValueError("bidirectional attention is not supported: this is a causal engine")
        super().__init__(config)

    def make_model(self, config: ModelConfig) -> nn.Module:
        return Gemma3Model(config)

    def compute_logits(self, hidden_states: torch.Tensor, all_tokens: bool = False) -> torch.Tensor:
        """Next-token logits (softcapped where configured): each sequence's last token, or every token."""
        logits = super().compute_logits(hidden_states, all_tokens)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
