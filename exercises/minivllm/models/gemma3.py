# Exercise copy of minivllm/models/gemma3.py, generated from it by scripts/make_exercises.py.
# Fill in: Gemma3DecoderLayer.__init__ (ch11), Gemma3DecoderLayer.forward (ch11), Gemma3ForCausalLM.compute_logits (ch11).
# Grade: make grade CH=11
# Running the generator again overwrites this file: commit or copy your work first.

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
        raise NotImplementedError(
            "ch11: Gemma 3's decoder layer, built: whether this layer is local (its entry of the "
            "config's layer_types says sliding attention; a config without layer_types has only "
            "global layers), the attention of Qwen3 told so and given Gemma's norm for its "
            "per-head q/k norm, a GeGLU feed-forward (the gated MLP with the tanh approximation of "
            "gelu) and four Gemma norms, named as the checkpoint names them: input_layernorm, "
            "post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm. "
            "Pitfall: a name that differs from the checkpoint's leaves that weight unloaded, see "
            "notebooks/11_model_families.ipynb"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # Each sub-block's output is normalised before it is added to the residual stream,
        # so there is no norm to fuse the add into: the adds stay plain, as in transformers.
        raise NotImplementedError(
            "ch11: Gemma 3's decoder layer, run: a sandwich of norms around each sub-block. "
            "Normalise the residual stream before attention, and normalise attention's output "
            "again before it is added back; the same around the feed-forward, with its own pair of "
            "norms. Pitfall: Llama adds the raw sub-block output; here the post norm comes first, "
            "see notebooks/11_model_families.ipynb"
        )


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
        raise NotImplementedError(
            "ch11: logit softcapping: the logits of the base class, squashed smoothly into (-cap, "
            "cap) where the config sets final_logit_softcapping: divide by the cap, take the "
            "hyperbolic tangent, multiply back. Near zero the logits barely move; the largest ones "
            "saturate. Without a cap the logits pass unchanged, see "
            "notebooks/11_model_families.ipynb"
        )
