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
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig):
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
        # Normalising each head's query and key keeps attention logits in range.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rotary_dim,
            config.rope_scaling,
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # q/k norm (where the config has it) and RoPE, in one step.
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        out = self.attn(q, k, v)
        return self.o_proj(out.flatten(1))


class Qwen3MLP(GatedMLP):
    """SwiGLU, sized by the config."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.hidden_size, config.intermediate_size, "silu")


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, make_mlp=Qwen3MLP):
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = make_mlp(config)  # the feed-forward: dense here, sparse in Qwen3-MoE
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse in its add.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """Decoder layer ``layer_idx``. A family whose layers differ overrides this."""
        return Qwen3DecoderLayer(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


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
