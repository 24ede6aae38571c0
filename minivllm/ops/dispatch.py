"""When to use a Triton kernel instead of the torch reference (the rule in ``minivllm.ops``).

On a CUDA device with Triton installed, the kernels run; everywhere else the reference
does. ``MINIVLLM_DISABLE_TRITON=1`` forces the reference (to compare the two on a GPU).
"""
import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and os.environ.get("MINIVLLM_DISABLE_TRITON") != "1"


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()
