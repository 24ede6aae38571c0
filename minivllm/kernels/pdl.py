"""Programmatic Dependent Launch (PDL, Hopper and later): overlapping a kernel's launch with
the end of the kernel before it.

At batch 1 a decode step is about 300 kernels of a few microseconds each, and between two
kernels in a stream the GPU sits idle for the next one's launch. A kernel launched with PDL
may start while the kernel before it is still finishing; it must then wait
(``griddepcontrol.wait``: Triton's ``gdc_wait``) before it reads anything that kernel wrote,
and it signals at once (``gdc_launch_dependents``) that the kernel after it may start too.
Work that does not depend on the kernel before, such as a gemv's first weight loads, can go
before the wait and overlap it. A kernel after one launched without PDL (cuBLAS, torch)
waits for it to finish, as always. CUDA graphs keep these edges.

``MINIVLLM_PDL=0`` turns it off, to compare.
"""
import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    """Hopper or later, and a Triton that can launch with PDL (3.4 and later; the package
    allows older ones, which run the kernels without it)."""
    if torch.cuda.get_device_capability(device_index)[0] < 9 or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a Triton without the NVIDIA backend's options where we look: no PDL
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_options(x: torch.Tensor) -> dict:
    """Launch options for a kernel that takes ``USE_PDL``: on for a CUDA device that has PDL
    (unless MINIVLLM_PDL=0), off elsewhere (Triton's interpreter included)."""
    if not x.is_cuda or os.environ.get("MINIVLLM_PDL", "1") == "0":
        return {"USE_PDL": False}
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return {"USE_PDL": True, "launch_pdl": True} if _pdl_capable(index) else {"USE_PDL": False}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Under PDL: wait until the kernel before has finished and its writes are visible, then
    let the kernel after this one start launching. Call it before the first load of
    anything an earlier kernel wrote, and before the first store. Loads of what was copied
    in before the step's first kernel (lengths, positions) or never changes (weights) may
    go before it. Every program calls it, one that ends early too: a kernel whose programs
    all skipped it could finish before the kernel before it, which the next would not wait for."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
