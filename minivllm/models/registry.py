"""Which class implements which checkpoint: keyed by config.json's ``architectures``."""
from torch import nn

from minivllm.models.gemma3 import Gemma3ForCausalLM
from minivllm.models.llama import LlamaForCausalLM
from minivllm.models.qwen2 import Qwen2ForCausalLM
from minivllm.models.qwen3 import Qwen3ForCausalLM
from minivllm.models.qwen3_moe import Qwen3MoeForCausalLM
from minivllm.models.qwen3_5 import Qwen3_5ForCausalLM
from minivllm.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from minivllm.models.qwen3_next import Qwen3NextForCausalLM

# Each class is named as config.json's ``architectures`` names the checkpoints it runs.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {cls.__name__: cls for cls in (
    Gemma3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
    Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM,
)}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        ) from None
