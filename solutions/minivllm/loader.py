# Reference copy of minivllm/loader.py, generated from it by scripts/make_exercises.py.
# Reference answers for: load_weights (ch01), _param_name_and_shard (ch01).
# Do not edit: change minivllm/loader.py and run scripts/make_exercises.py again.

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

Quantized weights (chapter 20) need no other loop: before loading, each quantized linear
layer gets its method (``layers.quantization``), which creates its parameters. A checkpoint
published in fp8 then holds a tensor for each (``weight`` in e4m3, ``weight_scale_inv``
beside it), found by the same names; a layer quantized at load takes its weight as
published and quantizes it after (``finish_loading``).
"""
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from minivllm.config import ModelConfig, text_tensor_name
from minivllm.layers.attention import Attention
from minivllm.layers.linear import Linear, default_weight_loader
from minivllm.layers.quantization import (Fp8BlockLinearMethod, UnquantizedLinearMethod, finish_loading,
                                          linear_method, quantizable, set_linear_methods)
from minivllm.models.registry import get_model_class
from minivllm.safetensors_index import safetensors_files, tensor_names

# Tensors some checkpoints carry that are recomputed from the config instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The multi-token-prediction head's tensors: not the model's, loaded only when asked for.
MTP_PREFIX = "mtp."
# One expert's projection in the hub's layout: "<prefix>.experts.<e>.<projection>.weight".
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# The block scales of an fp8 checkpoint's weight "<layer>.weight": "<layer>.weight_scale_inv".
BLOCK_SCALE_SUFFIX = ".weight_scale_inv"


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
    params.update(kv_scale_buffers(model))  # loaded where the checkpoint has them, 1.0 otherwise
    loaded: set[tuple[str, object]] = set()
    config = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", False)
    vision_language = getattr(config, "vision_language", False)

    for file in files:
        with safe_open(file, framework="pt") as f:
            for ckpt_name in f.keys():
                if prefix is not None:
                    if not ckpt_name.startswith(prefix):
                        continue
                    text_name = ckpt_name[len(prefix):]
                else:
                    text_name = text_tensor_name(ckpt_name) if vision_language else ckpt_name
                    if text_name is None or text_name.startswith(MTP_PREFIX):
                        continue  # the vision tower or the multi-token-prediction head
                if text_name.endswith(IGNORED_SUFFIXES) or (tied and text_name == "lm_head.weight"):
                    continue
                name, shard_id = _param_name_and_shard(text_name, packed, experts)
                if name not in params:
                    raise KeyError(f"checkpoint tensor {ckpt_name!r} in {file.name} has no place in {type(model).__name__}")
                param = params[name]
                tensor = f.get_tensor(ckpt_name).to(param.dtype)
                try:
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
                loaded.add((name, shard_id))

    whole = {n for n, s in loaded if s is None}  # a whole tensor covers all of its shards
    missing = sorted(f"{prefix or ''}{n}[{s}]" if s is not None else f"{prefix or ''}{n}"
                     for n, s in expected - loaded if n not in whole)
    if missing:
        raise KeyError(f"checkpoint {path} is missing tensors for: {', '.join(missing)}")


def kv_scale_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """A float8 KV cache's per-layer scales under the names a checkpoint gives them (vLLM's:
    ``model.layers.0.self_attn.k_scale`` for the attention layer ``...self_attn.attn``)."""
    buffers = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            owner = name.rpartition(".")[0]
            for scale in (module.k_scale, module.v_scale):
                scale.weight_loader = _load_kv_scale
            buffers.update({f"{owner}.k_scale": module.k_scale, f"{owner}.v_scale": module.v_scale})
    return buffers


def _load_kv_scale(scale: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """One scale for the whole layer, stored as a scalar or a one-element tensor."""
    if shard_id is not None or loaded.numel() != 1:
        raise ValueError(f"expected one scale per layer, got shape {tuple(loaded.shape)}")
    scale.copy_(loaded.reshape(()))


def _param_name_and_shard(ckpt_name: str, packed: dict, experts: dict) -> tuple[str, object]:
    match = EXPERT_TENSOR.match(ckpt_name)
    if match and match["proj"] in experts:
        our_part, part = experts[match["proj"]]
        return f"{match['prefix']}.{our_part}", (int(match["expert"]), part)
    for ckpt_part, (our_part, shard_id) in packed.items():
        if f".{ckpt_part}." in ckpt_name:
            return ckpt_name.replace(f".{ckpt_part}.", f".{our_part}."), shard_id
    return ckpt_name, None


def load_model(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    quantization: str | None = None,
) -> nn.Module:
    """Build the right model class for the checkpoint at ``path`` and load its weights;
    ``quantization="fp8"`` quantizes its linear layers (EngineConfig.quantization)."""
    config = ModelConfig.from_pretrained(path)
    model_class = get_model_class(config.architecture)
    dtype = dtype or config.torch_dtype
    method = linear_method(quantization, config.quantization_config)
    with torch.device(device):
        model = model_class(config)
    model.to(dtype)  # before any fp8 parameter exists: this cast would undo them
    if method is not None:
        set_linear_methods(quantized_layers(model, path, method), method)
    load_weights(model, path)
    finish_loading(model)
    return model.eval()


def quantized_layers(model: nn.Module, path: str | Path, method: UnquantizedLinearMethod) -> list[Linear]:
    """The linear layers ``method`` takes. Quantized at load: every one ``quantizable``
    names. A checkpoint published in fp8: those it holds in fp8 (with block scales), each of
    which must be a linear layer that loads its own weight; an fp8 tensor anywhere else
    (MoE experts, grouped projections) is refused rather than read without its scales."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    if not isinstance(method, Fp8BlockLinearMethod):
        return [layer for name, layer in layers.items() if quantizable(name)]
    packed = getattr(model, "packed_modules_mapping", {})
    experts = getattr(model, "expert_modules_mapping", {})
    vision_language = getattr(model.config, "vision_language", False)
    chosen = {}
    for ckpt_name in sorted(tensor_names(path)):
        text_name = text_tensor_name(ckpt_name) if vision_language else ckpt_name
        if text_name is None or text_name.startswith(MTP_PREFIX) or not text_name.endswith(BLOCK_SCALE_SUFFIX):
            continue
        name, _ = _param_name_and_shard(text_name, packed, experts)
        layer = layers.get(name.removesuffix(BLOCK_SCALE_SUFFIX))
        if layer is None or layer.weight.weight_loader != layer.weight_loader:
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: fp8 weights load into linear layers only; fp8 MoE "
                             "experts and grouped projections are not supported yet")
        chosen[id(layer)] = layer
    return list(chosen.values())
