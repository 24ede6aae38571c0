"""Tiny random-weight Hugging Face checkpoints, for tests and CPU notebooks.

The checkpoint is written by transformers itself (its config class and model), so what we
load is exactly what a real checkpoint of that family looks like, only small.
"""
from pathlib import Path

import torch

TINY_SHAPES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)

FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_tiny_checkpoint(
    path: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = True,
    max_shard_size: str | int | None = None,
    init_std: float = 0.08,
    **overrides,
) -> Path:
    """Write a random-weight checkpoint of ``family`` to ``path`` and return the path.

    ``overrides`` change config fields (e.g. ``num_hidden_layers=4``). ``init_std`` is larger
    than transformers' default so the logits of a random model are not all nearly equal,
    which would make greedy decoding a coin toss between near-ties.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; available: {sorted(FAMILIES)}")
    config_name, model_name = FAMILIES[family]
    fields = {**TINY_SHAPES, "tie_word_embeddings": tie_word_embeddings, "initializer_range": init_std}
    fields.update(overrides)
    config = getattr(transformers, config_name)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    # Norm weights start at exactly one; perturb them so a wrong norm cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path
