"""Qwen3 (dense): a pre-norm decoder with grouped-query attention, q/k RMSNorm and SwiGLU.

The module tree mirrors the checkpoint's tensor names (model.layers.N.self_attn.q_proj,
...) so loading is a lookup, except where we pack: q/k/v into ``qkv_proj`` and gate/up
into ``gate_up_proj`` (``packed_modules_mapping`` tells the loader which goes where).
"""
import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.attention import Attention
from minivllm.layers.embed_head import LMHead, VocabEmbedding, last_token_states
from minivllm.layers.linear import QKVLinear, RowParallelLinear
from minivllm.layers.mlp import GatedMLP
from minivllm.layers.moe import sparse_moe_block
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding


class Qwen3Attention(nn.Module):
    """Grouped-query attention with RoPE and, where the config has it, a q/k RMSNorm per head.
    Gemma 3 passes its own norm (``qk_norm``) and, for a local layer, ``sliding``: a window of
    ``config.sliding_window`` and RoPE at ``config.rope_local_theta``, unscaled."""

    def __init__(self, config: ModelConfig, qk_norm: type[nn.Module] | None = None, sliding: bool = False):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                  config.num_key_value_heads, bias=config.attention_bias)
        # The heads this rank computes: all of them in one process, a share of them under
        # tensor parallelism (chapter 16).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.o_proj_bias)
        # Normalising each head's query and key keeps attention logits in range.
        qk_norm = qk_norm or (RMSNorm if config.qk_norm else None)
        self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # BEGIN SOLUTION ch11 local_attention
        local_base = config.rope_local_theta if config.rope_local_theta is not None else 10000.0
        base, scaling = (local_base, None) if sliding else (config.rope_theta, config.rope_scaling)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, base, config.rotary_dim,
                                          scaling)
        scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=scale,
                              sliding_window=config.sliding_window if sliding else None)
        # END SOLUTION

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION ch02 attention_layer
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # q/k norm (where the config has it) and RoPE, in one step.
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        out = self.attn(q, k, v)
        return self.o_proj(out.flatten(1))
        # END SOLUTION


class Qwen3MLP(GatedMLP):
    """SwiGLU, sized by the config."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.intermediate_size, "silu")


def feed_forward(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s feed-forward: a router and experts where ``config.is_moe_layer``
    says so (Qwen3-MoE's rule, also Qwen3-Next's), the router renormalising with
    ``norm_topk_prob``; one dense SwiGLU elsewhere, and in every layer of a dense model."""
    if config.is_moe_layer(layer_idx):
        return sparse_moe_block(config, renormalize=config.norm_topk_prob)
    return Qwen3MLP(config)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = feed_forward(config, layer_idx)  # dense here, sparse in Qwen3-MoE's MoE layers
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse in its add.
        # BEGIN SOLUTION ch01 decoder_layer
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual
        # END SOLUTION


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION ch01 decoder_stack
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
        # END SOLUTION


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (our parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = self.make_model(config)
        tie = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tie_to=tie)

    def make_model(self, config: ModelConfig) -> nn.Module:
        """The decoder stack. Every family shares this wrapper (embedding in, logits out)
        and overrides only this: the stack is where families differ."""
        return Qwen3Model(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states for a flat batch of tokens ([num_tokens] ids and positions)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, all_tokens: bool = False) -> torch.Tensor:
        """Next-token logits: for each sequence's last token, or for every token."""
        if not all_tokens:
            hidden_states = last_token_states(hidden_states)
        return self.lm_head(hidden_states)
