"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``).

The same decoder as Qwen3 without the q/k norm, and with biases on the q, k and v
projections (but not on the output projection): ``ModelConfig`` reads both from the
config and confirms them from the checkpoint's tensors.
"""
from minivllm.models.qwen3 import Qwen3ForCausalLM


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    pass
