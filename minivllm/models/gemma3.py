"""Gemma 3, text only (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

The same grouped-query decoder as Qwen3 (q/k/v and gate/up packed the same way), with
Gemma's differences:

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
from minivllm.layers.attention import Attention
from minivllm.layers.embed_head import ScaledVocabEmbedding
from minivllm.layers.linear import QKVLinear, RowParallelLinear
from minivllm.layers.mlp import GatedMLP
from minivllm.layers.norm import GemmaRMSNorm
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.models.qwen3 import Qwen3ForCausalLM


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=config.attention_bias,
        )
        # The heads this rank computes: all of them in one process, a share of them under
        # tensor parallelism (chapter 16).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        layer_types = config.layer_types or ["full_attention"] * config.num_hidden_layers
        self.is_sliding = layer_types[layer_idx] == "sliding_attention"
        if self.is_sliding:
            base = config.rope_local_theta if config.rope_local_theta is not None else 10000.0
            scaling = None
        else:
            base, scaling = config.rope_theta, config.rope_scaling
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, base, config.rotary_dim, scaling
        )
        scalar = config.query_pre_attn_scalar or self.head_dim
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=scalar**-0.5,
            sliding_window=config.sliding_window if self.is_sliding else None,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out.flatten(1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx)
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
