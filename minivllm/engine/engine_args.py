"""From what a user writes (``LLM(model, dtype=..., max_num_seqs=...)``, ``minivllm serve
MODEL --max-num-seqs ...``) to an ``EngineConfig``: the model folder, the dtype, the device and
the engine's own fields, each checked before any weight is loaded. ``LLMEngine.from_engine_args``
is the one place that builds an engine from them: the offline ``LLM``, the server's in-process
engine and its engine-core process all go through it."""
import dataclasses
import os
from pathlib import Path

import torch

from minivllm.config import EngineConfig, ModelConfig, generation_defaults
from minivllm.sampling_params import SamplingParams

BUNDLED_MODEL = Path(__file__).parents[1] / "assets" / "bundled"
# The fields of EngineConfig a user may set by name (model, dtype and device are resolved first).
ENGINE_ARGS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "dtype", "device"}


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A local folder, a Hugging Face hub id (through the hub cache), or the bundled model."""
    if model is None:
        return BUNDLED_MODEL
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if str(model).count("/") != 1 or path.exists():
        raise ValueError(f"model {str(model)!r} is neither a local folder nor a hub id like 'Qwen/Qwen3-0.6B'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            str(model), allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
        ))
    except Exception as e:  # offline with no cached copy, unknown repo, no network...
        raise ValueError(f"could not find model {str(model)!r} locally or in the Hugging Face cache: {e}") from e


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # On a CPU, float32 is both faster and exact; on a GPU, the checkpoint's half type.
        if device.type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto' or one of {sorted(names)}")
    return names[dtype]


def create_engine_config(model: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
                         device: str | None = None, **engine_args) -> EngineConfig:
    """The EngineConfig for these arguments; a bad one raises ValueError naming it, before
    any weight is loaded."""
    unknown = set(engine_args) - ENGINE_ARGS
    if unknown:
        raise ValueError(f"unknown engine argument(s) {sorted(unknown)}; accepted: {sorted(ENGINE_ARGS)}")
    path = resolve_model(model)
    model_config = ModelConfig.from_pretrained(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = EngineConfig(model=str(path), dtype=resolve_dtype(dtype, model_config.torch_dtype, device),
                          device=str(device), **engine_args)
    config.check_max_model_len(model_config)
    # The checkpoint's suggested sampling settings, checked now rather than at the first request.
    SamplingParams(**generation_defaults(path, config.generation_config))
    return config
