# Exercise copy of minivllm/models/qwen3.py, generated from it by scripts/make_exercises.py.
# Fill in: Qwen3Attention.__init__ (ch11), Qwen3Attention.forward (ch02), Qwen3DecoderLayer.forward (ch01), Qwen3Model.forward (ch01).
# Grade: make grade CH=01; make grade CH=02; make grade CH=11
# Running the generator again overwrites this file: commit or copy your work first.

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
        raise NotImplementedError(
            "ch11: local or global attention: a local (sliding) layer rotates with its own RoPE "
            "base (rope_local_theta, 10000 where the config gives none) and no RoPE scaling, and "
            "attends over config.sliding_window positions; a global layer uses rope_theta with the "
            "config's scaling and no window. Every layer scales its logits by one over the square "
            "root of query_pre_attn_scalar where the config sets it, of the head size otherwise. "
            "Build self.rotary_emb (RotaryEmbedding) and self.attn (Attention) so, see "
            "notebooks/11_model_families.ipynb"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "ch02: the attention layer: one packed projection gives q, k and v side by side "
            "(q_size, then kv_size twice, along the last dimension); view each as [tokens, heads, "
            "head_dim], with num_heads query heads and num_kv_heads key/value heads. The rotary "
            "embedding rotates q and k to their positions (it applies the q/k norms too, given "
            "them); the attention module attends; the output heads are flattened back to one row "
            "per token for the output projection. Pitfall: k and v have fewer heads than q, see "
            "notebooks/02_attention.ipynb"
        )


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
        raise NotImplementedError(
            "ch01: the decoder layer, pre-norm: the input norm, self-attention, the post-attention "
            "norm, the MLP. The residual stream is carried beside the hidden states: the first "
            "layer gets None and its residual is its input; every later layer hands the norm its "
            "input and the residual, and the norm adds them and returns the normalised sum with "
            "the new residual. The post-attention norm adds the attention output into the residual "
            "the same way. Return the MLP's output and the residual, which the next layer adds. "
            "Pitfall: the attention output is added to the residual, never to the normalised "
            "input, see notebooks/01_weights_forward.ipynb"
        )


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "ch01: the decoder stack: embed the token ids, run every layer in order, each taking "
            "the positions, the hidden states and the residual stream (None before the first "
            "layer), then the final norm, which adds the last residual in; return its normalised "
            "output. Pitfall: the final norm without the residual drops the last layer's skip "
            "connection, see notebooks/01_weights_forward.ipynb"
        )


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
