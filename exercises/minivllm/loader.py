# Exercise copy of minivllm/loader.py, generated from it by scripts/make_exercises.py.
# Fill in: load_weights (ch01), _param_name_and_shard (ch01).
# Grade: make grade CH=01
# Running the generator again overwrites this file: commit or copy your work first.

"""Load a Hugging Face checkpoint (``*.safetensors``, sharded or not) into our modules.

For each tensor in the files: rename it if it belongs to a packed projection (q/k/v ->
qkv_proj, gate/up -> gate_up_proj) or is one expert's piece of a stacked expert parameter
(``experts.3.up_proj.weight`` -> ``experts.gate_up_proj``, shard (3, 1)), find the
parameter, and let the parameter's own ``weight_loader`` put it in place. Anything
missing, unexpected or misshapen is an error that names the tensor: a silently
half-loaded model writes fluent nonsense.

The text part of a vision-language checkpoint (``config.vision_language``, Qwen3.5's) is
loaded the same way after ``text_tensor_name`` strips ``model.language_model.`` down to
``model.``; the vision tower (``model.visual.*``) and the multi-token-prediction head
(``mtp.*``, in text checkpoints too) are skipped on purpose, being no part of the text
model. The MTP head is loaded on its own, into its own module, with ``prefix="mtp."``
(speculative decoding, ``minivllm.spec_decode.mtp``).
"""
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minivllm.config import ModelConfig, text_tensor_name
from minivllm.layers.linear import default_weight_loader
from minivllm.models.registry import get_model_class
from minivllm.safetensors_index import safetensors_files

# Tensors some checkpoints carry that are recomputed from the config instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The multi-token-prediction head's tensors: not the model's, loaded only when asked for.
MTP_PREFIX = "mtp."
# One expert's projection in the hub's layout: "<prefix>.experts.<e>.<projection>.weight".
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


def load_weights(model: nn.Module, path: str | Path, prefix: str | None = None) -> None:
    """Load the checkpoint at ``path`` into ``model``; with ``prefix`` (e.g. ``"mtp."``),
    only the tensors whose names start with it, named without it, and the rest skipped."""
    files = safetensors_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    packed = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_modules_mapping", {})
    params = dict(model.named_parameters())  # tied weights appear once, under the embedding
    # What the checkpoint must provide: a packed or stacked parameter names its pieces
    # (shard_ids), any other is one whole tensor.
    expected = {(name, shard) for name, p in params.items() for shard in getattr(p, "shard_ids", [None])}
    loaded: set[tuple[str, object]] = set()
    config = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", False)
    vision_language = getattr(config, "vision_language", False)

    raise NotImplementedError(
        "ch01: load_weights, the loop over the checkpoint: open every safetensors file and walk "
        "its tensor names. With prefix, a tensor belongs here only when its name starts with "
        "prefix, and it is known by the rest of its name; without one, the name goes through "
        "text_tensor_name for a vision-language checkpoint, which answers None for the vision "
        "tower, and the multi-token-prediction head (names from MTP_PREFIX) is skipped. Skip as "
        "well the tensors the model recomputes (IGNORED_SUFFIXES) and the LM head when it is tied "
        "to the embedding. Map the name (and shard) with _param_name_and_shard, find the parameter "
        "(a name with no parameter is a KeyError that names the tensor and its file), cast the "
        "tensor to the parameter's dtype and hand it to the parameter's own weight_loader "
        "(default_weight_loader when it has none); a ValueError from it is raised again naming the "
        "tensor. Record every (name, shard) loaded. At the end, what was expected and not loaded "
        "is missing (a whole tensor loaded covers all its shards): a KeyError naming each missing "
        "piece, prefix included. Pitfall: a model that loads with tensors missing writes fluent "
        "nonsense, see notebooks/01_weights_forward.ipynb"
    )


def _param_name_and_shard(ckpt_name: str, packed: dict, experts: dict) -> tuple[str, object]:
    raise NotImplementedError(
        "ch01: _param_name_and_shard: where a checkpoint tensor goes. One expert's projection "
        "(EXPERT_TENSOR matches it and its projection is in experts) goes to the experts' stacked "
        "parameter, at shard (expert number as an int, part). A projection that we pack (a key of "
        "packed, as a whole dotted component of the name) is renamed to the packed parameter and "
        "carries its shard id. Anything else keeps its name, with no shard. Pitfall: matching the "
        "part without its dots also renames names that merely contain it, see "
        "notebooks/01_weights_forward.ipynb"
    )


def load_model(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> nn.Module:
    """Build the right model class for the checkpoint at ``path`` and load its weights."""
    config = ModelConfig.from_pretrained(path)
    model_class = get_model_class(config.architecture)
    dtype = dtype or config.torch_dtype
    with torch.device(device):
        model = model_class(config)
    model.to(dtype)
    load_weights(model, path)
    return model.eval()
