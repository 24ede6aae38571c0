"""Qwen3.5 (text, ``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``): a hybrid decoder.

Most layers mix tokens with Gated DeltaNet linear attention (``layers.gated_deltanet``):
a fixed-size recurrent state per sequence, no KV cache. Every few layers (``layer_types``,
by default one in four) is full attention over the paged KV cache, with Qwen3.5's
differences from Qwen3:

- the query projection also produces an output gate per head ([q | gate] for each head):
  the attention output is multiplied by sigmoid(gate) before ``o_proj``;
- partial rotary: only the first quarter of each head's channels carry position;
- every RMSNorm of the decoder (layer norms, q/k norms, the final norm) scales by
  ``1 + weight`` in float32 (weights centred on zero), as Gemma's; the gated norm inside
  the linear-attention layers scales by ``weight``.

The checkpoints also carry a multi-token-prediction head (``mtp.*``, see
``Qwen3_5MultiTokenPredictor``) that the target model does not use; speculative decoding
drafts with it (``minivllm.spec_decode.mtp``).
"""
import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.attention import Attention
from minivllm.layers.embed_head import VocabEmbedding
from minivllm.layers.gated_deltanet import GatedDeltaNet
from minivllm.layers.linear import Linear, PackedLinear, replicated_shards
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.layers.norm import GemmaRMSNorm
from minivllm.models.qwen3 import Qwen3ForCausalLM, feed_forward

LINEAR, FULL = "linear_attention", "full_attention"


def hybrid_layer_types(config: ModelConfig) -> list[str]:
    """Which layers are linear attention and which full: config.json's ``layer_types``,
    or the default pattern of one full-attention layer every ``full_attention_interval``."""
    hf = config.hf_config
    types = hf.get("layer_types")
    if types is None:
        interval = hf.get("full_attention_interval", 4)
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must name {LINEAR!r} or {FULL!r} for each of the "
                         f"{config.num_hidden_layers} layers, got {types}")
    return list(types)


class Qwen3_5Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.hf_config.get("attention_bias", False)
        # q_proj's rows hold, per head, head_dim query rows then head_dim gate rows.
        self.qkv_proj = PackedLinear(
            config.hidden_size, replicated_shards({"q": 2 * self.q_size, "k": self.kv_size, "v": self.kv_size}),
            bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, config.rope_theta, config.rotary_dim, config.rope_scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj(hidden_states).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        out = self.attn(q, k, v).flatten(1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, layer_type: str, make_mlp=feed_forward,
                 linear_attention=GatedDeltaNet):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == LINEAR:
            hf = config.hf_config
            self.linear_attn = linear_attention(
                config.hidden_size, hf["linear_num_key_heads"], hf["linear_num_value_heads"], hf["linear_key_head_dim"],
                hf["linear_value_head_dim"], hf.get("linear_conv_kernel_dim", 4), config.rms_norm_eps)
        else:
            self.self_attn = Qwen3_5Attention(config)
        self.mlp = make_mlp(config, layer_idx)  # the feed-forward: dense here, sparse in the MoE families
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(hidden_states)
        x = self.linear_attn(x) if self.layer_type == LINEAR else self.self_attn(positions, x)
        hidden_states = hidden_states + x
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Qwen3_5Model(nn.Module):
    """The hybrid stack; its relatives give their feed-forward (``make_mlp(config, layer_idx)``,
    by default Qwen3's rule) and Qwen3-Next its Gated DeltaNet layer (``linear_attention``)."""

    def __init__(self, config: ModelConfig, make_mlp=feed_forward, linear_attention=GatedDeltaNet):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, i, t, make_mlp, linear_attention)
                                    for i, t in enumerate(hybrid_layer_types(config)))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class Qwen3_5MultiTokenPredictor(nn.Module):
    """The multi-token-prediction (MTP) head of Qwen3.5 and Qwen3-Next checkpoints, the
    ``mtp.*`` tensors: from the target's hidden state at position j (after its final norm)
    and the embedding of token j + 1, it predicts token j + 2, through the target's LM head.

        x = fc([pre_fc_norm_embedding(embed(t_{j+1})) | pre_fc_norm_hidden(h_j)])   2H -> H
        out = norm(layer(x))     one full-attention decoder layer, attending over the head's
                                 own keys and values at positions 0..j

    The norms are the decoder's (``1 + weight``); the layer is a full-attention layer of the
    family (gated attention, partial rotary), numbered after the decoder's last for its
    feed-forward rule (``make_mlp``: dense, or experts in the MoE families). The embedding
    and the LM head are the target's (``mtp_use_dedicated_embeddings`` is false in every
    published config), so they are not part of this module. ``out`` is also the hidden
    state the head takes in place of h_j to predict one more token from its own guess.
    """

    def __init__(self, config: ModelConfig, make_mlp=feed_forward, num_layers: int = 1):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = GemmaRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(hidden, eps)
        self.fc = Linear(2 * hidden, hidden)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, config.num_hidden_layers + i, FULL, make_mlp)
                                    for i in range(num_layers))
        self.norm = GemmaRMSNorm(hidden, eps)

    def forward(self, embeds: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds: [num_tokens, H], the next tokens' embeddings; hidden_states: [num_tokens, H],
        the target's (or this head's own) at the same positions. Returns [num_tokens, H]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden_states)], dim=-1))
        return self.norm(self.layers[0](positions, x))


class Qwen3_5ForCausalLM(Qwen3ForCausalLM):
    packed_modules_mapping = {
        **Qwen3ForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }
    make_mlp = staticmethod(feed_forward)  # each layer's feed-forward: (config, layer_idx) -> module

    def make_model(self, config: ModelConfig) -> nn.Module:
        return Qwen3_5Model(config, make_mlp=self.make_mlp)

    @classmethod
    def make_mtp(cls, config: ModelConfig, num_layers: int = 1) -> nn.Module:
        """The checkpoint's MTP head (``mtp.*``), loaded as the model is (the same packed
        projections and experts)."""
        head = Qwen3_5MultiTokenPredictor(config, cls.make_mlp, num_layers)
        head.packed_modules_mapping = cls.packed_modules_mapping
        head.expert_modules_mapping = getattr(cls, "expert_modules_mapping", {})
        return head
