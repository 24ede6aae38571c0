"""Functional ops, one entry point each: what a layer calls to compute.

**The dispatch rule.** A layer (``minivllm.layers``) calls an op; the op picks the torch
reference or the Triton kernel (``minivllm.kernels``); models and layers never import
``kernels``. The choice is made in one place, ``dispatch.use_triton``: the kernel runs on
a CUDA tensor when Triton is installed (and not switched off), the reference everywhere
else. An op may add a condition of its own where its kernel covers only some shapes (the
fused RoPE kernel needs a power-of-two head_dim; ``kernels.gemv`` serves only a few rows),
and says so at the point where it chooses. Kernel files import Triton, so an op imports
them inside the branch that uses them: the package imports on a machine without Triton.

The torch reference of each op is also its spec: the kernel tests compare the two on
random inputs.
"""
