"""From what a user writes (``LLM(model, dtype=..., max_num_seqs=...)``, ``minivllm serve
MODEL --max-num-seqs ...``) to an ``EngineConfig``: the model folder, the dtype, the device and
the engine's own fields, each checked before any weight is loaded. ``LLMEngine.from_engine_args``
is the one place that builds an engine from them: the offline ``LLM``, the server's in-process
engine and its engine-core process all go through it."""
import dataclasses
import difflib
import logging
import os
from pathlib import Path

import torch

from minivllm.config import EngineConfig, ModelConfig, generation_defaults
from minivllm.sampling_params import SamplingParams

BUNDLED_MODEL = Path(__file__).parents[1] / "assets" / "bundled"
# The fields of EngineConfig a user may set by name (model, dtype and device are resolved first).
ENGINE_ARGS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "dtype", "device"}

logger = logging.getLogger(__name__)

# vLLM's engine arguments that a script or a command line copied from vLLM commonly passes, and
# what minivllm makes of each (``vllm_engine_args``). Accepted: they change nothing on this
# engine, and a notice says why. Refused: out of minivllm's scope, the message says what it does
# instead. (``tokenizer``, ``revision``,
# ``enable_chunked_prefill`` and ``pipeline_parallel_size`` are accepted for some values only,
# see ``vllm_engine_args``.)
ACCEPTED_VLLM_ARGS = {
    "trust_remote_code": "minivllm runs no code from a checkpoint: its architecture must be one minivllm implements",
    "disable_log_stats": "minivllm's engine logs no periodic statistics (the server's are on /metrics)",
    "enable_auto_tool_choice": "tool_choice='auto' is always on (parsed by --tool-call-parser, hermes by default)",
    "swap_space": "a preempted request is recomputed, never swapped to the CPU",
    "disable_custom_all_reduce": "tensor parallelism uses NCCL's all-reduce only",
    "tokenizer_mode": "the tokenizer is the checkpoint's fast (tokenizers) one",
    "download_dir": "a hub model is read from the Hugging Face cache",
    "load_format": "weights are read from the checkpoint's safetensors files",
    "reasoning_parser": "offline, the text keeps the model's reasoning; minivllm serve --reasoning-parser splits it "
                        "from the answer",
}
REFUSED_VLLM_ARGS = {
    "enable_lora": "LoRA adapters are not supported: merge the adapter into the weights and serve the merged folder",
    "max_loras": "LoRA adapters are not supported: merge the adapter into the weights and serve the merged folder",
    "max_lora_rank": "LoRA adapters are not supported: merge the adapter into the weights and serve the merged folder",
    "lora_modules": "LoRA adapters are not supported: merge the adapter into the weights and serve the merged folder",
    "limit_mm_per_prompt": "minivllm serves text models only: no image, audio or video inputs",
    "mm_processor_kwargs": "minivllm serves text models only: no image, audio or video inputs",
    "cpu_offload_gb": "weights stay on the device: use a smaller model or more GPUs (tensor_parallel_size)",
    "data_parallel_size": "one engine per process: start several servers behind a load balancer instead",
}
ALL_KNOWN_ARGS = sorted(ENGINE_ARGS | {"model", "dtype", "device", "tokenizer", "revision", "quantization",
                                       "enable_chunked_prefill", "pipeline_parallel_size"}
                        | set(ACCEPTED_VLLM_ARGS) | set(REFUSED_VLLM_ARGS))


def resolve_model(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """A local folder, a Hugging Face hub id (through the hub cache, at ``revision`` if one is
    given: a branch, tag or commit), or the bundled model."""
    local = model is None or Path(model).expanduser().is_dir()
    if revision is not None and local:
        raise ValueError(f"revision={revision!r} applies to a hub id; {str(model or 'the bundled model')!r} is a "
                         f"local folder")
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
            str(model), revision=revision, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
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


def unknown_name_error(kind: str, unknown, known) -> ValueError:
    """The error for names nobody knows (a typo, most often), each with the closest known one."""
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(f"unknown {kind}(s) {', '.join(parts)}; accepted: {', '.join(sorted(known))}")


def vllm_engine_args(engine_args: dict) -> tuple[dict, str | None]:
    """``engine_args`` without vLLM's keywords that mean nothing more here, and the hub
    revision to load. Raises ValueError naming a keyword minivllm refuses, and for a name
    neither knows, the closest known one; logs a one-line notice for each accepted one."""
    args = dict(engine_args)
    unknown = set(args) - set(ALL_KNOWN_ARGS)
    if unknown:
        raise unknown_name_error("engine argument", unknown, ALL_KNOWN_ARGS)
    for name in sorted(set(args) & set(REFUSED_VLLM_ARGS)):
        value = args.pop(name)
        if value and not (name == "data_parallel_size" and value == 1):  # off, or one: nothing to refuse
            raise ValueError(f"{name}: {REFUSED_VLLM_ARGS[name]}")
    for name in sorted(set(args) & set(ACCEPTED_VLLM_ARGS)):
        if args.pop(name) not in (None, False):
            logger.info("%s accepted and changes nothing: %s", name, ACCEPTED_VLLM_ARGS[name])
    if args.pop("pipeline_parallel_size", None) not in (None, 1):
        raise ValueError("pipeline_parallel_size: pipeline parallelism is not supported; split the model across "
                         "GPUs with tensor_parallel_size instead")
    if args.pop("enable_chunked_prefill", None) is False:
        logger.info("enable_chunked_prefill=False changes nothing: minivllm always splits a long prompt across "
                    "steps (max_num_batched_tokens tokens per step)")
    if args.get("seed", 0) is None:  # vLLM's "no fixed seed"; the engine's generator wants one
        del args["seed"]
    return args, args.pop("revision", None)


def check_tokenizer(tokenizer, model, path: Path) -> None:
    """vLLM's ``tokenizer=``: only the model's own (its name or its folder)."""
    if tokenizer is None or str(tokenizer) == str(model):
        return
    if not Path(tokenizer).expanduser().is_dir() or Path(tokenizer).expanduser().resolve() != path.resolve():
        raise ValueError(f"tokenizer={str(tokenizer)!r}: minivllm reads the tokenizer from the model's own folder; "
                         f"leave tokenizer out, or give the model's path")


def create_engine_config(model: str | os.PathLike | None = None, dtype: str | torch.dtype = "auto",
                         device: str | None = None, **engine_args) -> EngineConfig:
    """The EngineConfig for these arguments; a bad one raises ValueError naming it, before
    any weight is loaded. vLLM's own keywords are understood as ``vllm_engine_args`` says."""
    tokenizer = engine_args.pop("tokenizer", None)
    engine_args, revision = vllm_engine_args(engine_args)
    path = resolve_model(model, revision)
    check_tokenizer(tokenizer, model, path)
    model_config = ModelConfig.from_pretrained(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = EngineConfig(model=str(path), dtype=resolve_dtype(dtype, model_config.torch_dtype, device),
                          device=str(device), **engine_args)
    config.check_max_model_len(model_config)
    # The checkpoint's suggested sampling settings, checked now rather than at the first request.
    SamplingParams(**generation_defaults(path, config.generation_config))
    return config
