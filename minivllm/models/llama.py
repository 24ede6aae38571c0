"""Llama 2 / 3 / 3.1 (``LlamaForCausalLM``).

The same pre-norm decoder as Qwen3, minus the q/k norm: one module serves both, and the
checkpoint's config (and tensors) switch the differences on and off. What Llama brings is
in the config: Llama 3.1's "llama3" RoPE scaling (``layers.rotary.llama3_scale_inv_freq``)
and, usually, an untied LM head.
"""
from minivllm.models.qwen3 import Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    pass
